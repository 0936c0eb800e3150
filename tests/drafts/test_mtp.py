"""The MTP/NextN draft layer against transformers' MTP implementation (fixtures with an MTP layer)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.cache import page_table_array, slots_for
from mtp_jax.drafts.mtp import draft as mtp
from mtp_jax.targets.deepseek_v3.model import PagedAttention, init_cache
from tests.conftest import PARITY_DIR

# jitted: op by op, one call compiled ~100-500 one-op programs (~17 s for this file's costliest test)
mtp_forward = jax.jit(mtp.mtp_forward, static_argnames=("cfg", "dispatch"))
mtp_chain_teacher_forced = jax.jit(mtp.mtp_chain_teacher_forced, static_argnames=("cfg", "depth", "dispatch"))


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=["fp8_mtp", "sharded_mtp_bf16"])
def case(request):
    path = os.path.join(PARITY_DIR, request.param)
    weights = "fp8" if request.param.startswith("fp8") else "dense"
    return mtp_jax.load(path, "float32", weights=weights), np.load(os.path.join(path, "reference.npz"))


def test_mtp_teacher_forced_matches_transformers(case):
    model, ref = case
    ids = ref["input_ids"]
    hidden = model.hidden_states(ids).post_norm
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t - 1), (b, t - 1))
    args = (model.params, model.config, jnp.asarray(ids[:, 1:]), jnp.asarray(hidden[:, :-1]), pos)
    out = mtp_forward(*args, dispatch="sorted")
    assert rel_err(out.logits, ref["mtp_logits"]) < 1e-5
    assert rel_err(out.state, ref["mtp_hidden"]) < 1e-5
    dense = mtp_forward(*args, dispatch="dense")  # the training path
    assert rel_err(dense.logits, ref["mtp_logits"]) < 1e-5
    assert float(out.expert_load.sum()) == b * (t - 1) * model.config.num_experts_per_tok


def test_mtp_paged_in_chunks_matches_transformers(case):
    """The serving form: rows written to the MTP layer's own paged cache a few at a time."""
    model, ref = case
    ids = ref["input_ids"]
    hidden = jnp.asarray(model.hidden_states(ids).post_norm)
    b, t = ids.shape
    page = 4
    width = -(-t // page)
    table = jnp.asarray(page_table_array([list(range(i, b * width, b)) for i in range(b)], width))
    pages = init_cache(model.config, b * width, page, jnp.float32)["moe"][0]
    got = []
    for lo, hi in [(0, 5), (5, 6), (6, t - 1)]:
        pos = jnp.broadcast_to(jnp.arange(lo, hi), (b, hi - lo))
        paged = PagedAttention(pages, slots_for(table, pos, jnp.ones(pos.shape, bool), page), table)
        out = mtp_forward(
            model.params, model.config, jnp.asarray(ids[:, lo + 1 : hi + 1]), hidden[:, lo:hi], pos, paged
        )
        pages = out.pages
        got.append(np.asarray(out.logits))
    assert rel_err(np.concatenate(got, axis=1), ref["mtp_logits"]) < 1e-5


@pytest.mark.parametrize("case", ["sharded_mtp_bf16"], indirect=True)
def test_chain_teacher_forced_matches_the_decode_chain(case):
    """Training's chained levels (dense, all rows at once) equal decoding's chain over the paged
    cache: catch-up rows 0..i from the target's states, then the MTP layer fed its own state and
    the next token at positions i+1, i+2 (true tokens standing in for the drafts)."""
    model, ref = case
    ids = jnp.asarray(ref["input_ids"])
    hidden = jnp.asarray(model.hidden_states(ref["input_ids"]).post_norm)
    b, t = ids.shape
    depth = 3
    n = t - 1 - depth
    levels = mtp_chain_teacher_forced(model.params, model.config, ids, hidden, depth, dispatch="sorted")
    assert [lv.logits.shape for lv in levels] == [(b, n, model.config.vocab_size)] * depth
    first = mtp_forward(model.params, model.config, ids[:, 1 : 1 + n], hidden[:, :n], jnp.arange(n)[None])
    assert rel_err(levels[0].logits, first.logits) < 1e-5
    page = 4
    width = -(-t // page)
    table = jnp.asarray(page_table_array([list(range(r * width, (r + 1) * width)) for r in range(b)], width))
    for i in (0, n - 1):
        pages = init_cache(model.config, b * width, page, jnp.float32)["moe"][0]
        pos = jnp.broadcast_to(jnp.arange(i + 1), (b, i + 1))
        paged = PagedAttention(pages, slots_for(table, pos, jnp.ones(pos.shape, bool), page), table)
        out = mtp_forward(model.params, model.config, ids[:, 1 : i + 2], hidden[:, : i + 1], pos, paged)
        state = out.state[:, -1:]
        assert rel_err(out.logits[:, -1], levels[0].logits[:, i]) < 1e-5
        for j in range(2, depth + 1):
            pos = jnp.full((b, 1), i + j - 1)
            paged = PagedAttention(out.pages, slots_for(table, pos, jnp.ones(pos.shape, bool), page), table)
            out = mtp_forward(model.params, model.config, ids[:, i + j : i + j + 1], state, pos, paged)
            state = out.state
            assert rel_err(out.logits[:, 0], levels[j - 1].logits[:, i]) < 1e-5, (i, j)
