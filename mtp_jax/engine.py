"""Host side of plain decoding: batching, cache allocation, the decode loop, stop conditions.

The host reads each step's tokens one step late: step n+1 is dispatched before the tokens of
step n are copied back, so the device never waits for host bookkeeping.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from mtp_jax.cache import PageAllocator, init_pages, page_table_array
from mtp_jax.config import DeepseekV3Config
from mtp_jax.sampling import SamplingParams
from mtp_jax.step import decode_step, prefill

TokenCallback = Callable[[int, int], None]
"""Called as ``on_token(prompt_index, token_id)`` for every emitted token, in order."""


@dataclasses.dataclass
class GenerateResult:
    """New tokens per prompt (EOS included when it stopped the row), why each row stopped
    ("eos" or "length"), and run statistics."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict[str, float | int]


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def generate_plain(
    params: dict,
    cfg: DeepseekV3Config,
    *,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int],
    page_size: int,
    cache_dtype: jnp.dtype,
    on_token: TokenCallback | None = None,
) -> GenerateResult:
    """Autoregressive decoding of validated prompts in one static batch."""
    t_start = time.perf_counter()
    n = len(prompts)
    batch = next_power_of_two(n)
    lengths = [len(p) for p in prompts] + [1] * (batch - n)
    bucket = next_power_of_two(max(lengths), minimum=16)
    # Every row owns pages for its prompt plus all new tokens; widths are bucketed to limit compiles.
    need = [math.ceil((length + max_new_tokens) / page_size) for length in lengths]
    width = next_power_of_two(max(max(need), math.ceil(bucket / page_size)))
    allocator = PageAllocator(batch * width)
    table = page_table_array([allocator.allocate(k) for k in need], width)
    pages = init_pages(cfg, allocator.num_pages, page_size, cache_dtype)

    tokens = np.zeros((batch, bucket), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    seq_lens = np.asarray(lengths, np.int32)
    sampling = sampling.pad(batch)
    table = jnp.asarray(table)

    pending, _, pages = prefill(params, pages, cfg, page_size, tokens, jnp.asarray(seq_lens), table, sampling)
    pending.block_until_ready()
    t_prefill = time.perf_counter()

    eos = frozenset(eos_token_ids)
    out: list[list[int]] = [[] for _ in range(n)]
    finish = [""] * n
    decode_steps = 0
    for i in range(max_new_tokens):
        if i + 1 < max_new_tokens:
            nxt, _, pages = decode_step(params, pages, cfg, page_size, pending, seq_lens, table, sampling)
            decode_steps += 1
            seq_lens = seq_lens + 1
        emitted = np.asarray(pending)
        for row in range(n):
            if finish[row]:
                continue
            tok = int(emitted[row])
            out[row].append(tok)
            if on_token is not None:
                on_token(row, tok)
            if tok in eos:
                finish[row] = "eos"
            elif len(out[row]) >= max_new_tokens:
                finish[row] = "length"
        if all(finish):
            break
        pending = nxt
    t_end = time.perf_counter()

    new_tokens = sum(len(o) for o in out)
    decode_time = t_end - t_prefill
    stats = {
        "prompts": n,
        "batch": batch,
        "prompt_tokens": sum(lengths[:n]),
        "new_tokens": new_tokens,
        "steps": decode_steps + 1,
        "decode_steps": decode_steps,
        "prefill_seconds": t_prefill - t_start,
        "decode_seconds": decode_time,
        "tokens_per_second": new_tokens / max(t_end - t_start, 1e-9),
        "decode_tokens_per_second": (new_tokens - n) / max(decode_time, 1e-9),
        "acceptance_length": 1.0,
    }
    return GenerateResult(tokens=out, finish_reasons=finish, stats=stats)
