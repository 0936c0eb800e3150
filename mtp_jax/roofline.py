"""The unified step against its memory roofline: bytes a step must read, and how long it takes.

    python scripts/bench_step.py                                   # the embedded model, K = 0 1 3
    python scripts/bench_step.py --k 0 3 --context 4096 --json step.json
    python scripts/bench_step.py --config configs/deepseek-v3.json --weights fp8 \\
        --set num_hidden_layers=4 --context 32768 --k 0 3          # V3's real layer sizes, 4 layers

Decode at small batch is memory-bound: a step cannot be faster than the bytes it must read divided
by the memory bandwidth. Those bytes, counted from the parameters the step actually holds:

- **target**: every weight of the main model once, except the routed experts (only those the step's
  ``B·(K+1)`` tokens are routed to) and the embedding table (only the rows looked up);
- **draft** (K > 0): the MTP layer runs K times one after another (the catch-up over the K+1
  verified rows, then K-1 chained single-token passes), so its weights are read K times, each pass
  with the experts of its own tokens; the output head it shares with the target is read K more
  times (one draft distribution per pass);
- **KV**: every target layer reads each row's cache up to the step's last position
  (``context + K + 1`` positions: DeepSeek-V3's latent rows, Llama's K and V), and each MTP pass
  reads the MTP layer's cache the same way.

Routed experts are counted at their expected number under independent uniform routing: ``n``
tokens each picking ``top_k`` of ``E`` experts touch ``E·(1 - (1 - top_k/E)^n)`` distinct ones.
Real routing is skewed, so the true number is usually a little lower; the breakdown shows how much
that term weighs. Writes (the K+1 new cache rows per layer) are left out: they are a few rows.

The step is timed in isolation (the engine's jitted :func:`mtp_jax.step.step`, the same program
generation runs) at a fixed context: each call starts from the same committed length, so every
call reads the same bytes. Calls are dispatched back to back and waited for once per round, as the
engine dispatches a step before reading the previous one's tokens. ``--profile DIR`` also traces a
few steps with :mod:`jax.profiler` and lists the costliest device operations (on a GPU, its
kernels; the full trace opens in Perfetto or TensorBoard).

The bandwidth limit is the higher of two measurements: a jitted copy of a large buffer (read +
write) and a matrix-vector product over one (reads only, the decode pattern). On an H100 the copy
reached 2.9-3.0 TB/s once timed back to back (2.0-2.4 TB/s when each call was waited for); on a
CPU the copy is several times slower (its fresh output buffer is faulted in page by page), so the
matrix-vector rate is the honest limit there.
The ratio step / roofline is what the kernels are judged by (issue 7: within 1.5x at batch 1 on
the H200). On a CPU the tiny model's weights sit in the caches, so the ratio there measures
dispatch overhead as much as memory traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.drafts.base import StepReads
from mtp_jax.param_bytes import expected_experts, is_routed_expert, nbytes, path_names
from mtp_jax.timing import _timed_state, timed_back_to_back, timed_call_state

WEIGHT_CHOICES = ("dense", "fp8")
PROFILE_TOP = 25  # operations listed per K by --profile


def copy_bandwidth(megabytes: int, iters: int) -> float:
    """Bytes/s of a jitted copy of a ``megabytes`` buffer (each byte read once and written once)."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)
    y = jax.block_until_ready(copy(copy(x)))  # compile, warm up
    times = []
    for _ in range(5):  # chained back to back: at most two buffers live, however large
        t0 = time.perf_counter()
        for _ in range(iters):
            y = copy(y)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - t0) / iters)
    return 2 * x.nbytes / statistics.median(times)


def read_bandwidth(megabytes: int, iters: int) -> float:
    """Bytes/s of a jitted float32 matrix-vector product over a ``megabytes`` matrix: each byte read
    once and almost nothing written, the access pattern of batch-1 decode."""
    cols = 4096
    w = jnp.ones((max(1, megabytes * 2**20 // (4 * cols)), cols), jnp.float32)
    v = jnp.ones((cols,), jnp.float32)
    matvec = jax.jit(lambda a, b: a @ b)
    return w.nbytes / timed_back_to_back([lambda: matvec(w, v)], iters)


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes one step must read, by what reads them (see the module docstring)."""

    target_weights: float  # main model without routed experts, embedding rows only, head once
    target_experts: float  # routed experts the verified tokens are expected to touch
    draft_weights: float  # the MTP layer without routed experts, K passes
    draft_experts: float  # its routed experts, per pass those of the pass's tokens
    draft_heads: float  # the output head, once per draft
    kv: float  # latent cache read by every target layer and every MTP pass

    @property
    def total(self) -> float:
        return sum(dataclasses.asdict(self).values())


def step_bytes(
    params: dict,
    cfg: Any,
    *,
    k: int,
    batch: int,
    context: int,
    cache_itemsize: int,
    draft_cfg: Any = None,
    draft: str | None = None,
) -> StepBytes:
    """Bytes a step of ``batch`` rows at committed length ``context`` with ``k`` drafts reads.

    ``params`` is the loaded parameter tree (arrays or ShapeDtypeStructs; FP8 weights count their
    bytes and scales); ``cache_itemsize`` the bytes of one cache value. The drafts come from the
    MTP layer, or with ``draft_cfg`` (an :class:`mtp_jax.drafts.eagle3.config.Eagle3Config`) from the EAGLE-3
    draft
    in ``params["eagle3"]``: its layer read once per pass, ``fc`` once (only the catch-up reads
    target features), its own head over the draft vocabulary once per draft, its paged K/V (or
    latent) cache read by every pass; or (a :class:`mtp_jax.drafts.dflash.config.DFlashConfig`) from the
    DFlash
    draft in ``params["dflash"]``: ONE block forward, so every draft weight, the target's head (for
    all K rows at once) and every draft layer's paged context K/V are read once; the embedding rows
    of the anchors and the mask token. ``draft`` names a registered draft instead (e.g. "ngram",
    which has no config); each draft's terms are its ``step_reads`` hook.
    """
    if min(batch, context) < 1 or k < 0:
        raise ValueError(f"need batch >= 1, context >= 1, k >= 0; got {batch}, {context}, {k}")
    from mtp_jax.drafts import DRAFTS
    from mtp_jax.targets import target_for

    name = draft or draft_method(cfg, draft_cfg)
    if k and name is None:
        raise ValueError("k > 0 needs a draft: this model has none of its own; name one (draft=)")
    draft = DRAFTS[name] if k else None  # plain decoding: nothing drafts
    why = None if draft is None else draft.available(params, cfg)
    if why is not None:
        raise ValueError(f"k > 0 needs the {draft.title or draft.name} draft in params: {why}")
    e, top_k = target_for(cfg).routed_experts(cfg)
    moe = e > 0
    tied = "lm_head" not in params  # the head reads the whole embedding
    verified = batch * (k + 1)
    positions = batch * (context + k + 1)
    reads = StepReads()
    if draft is not None and draft.step_reads is not None:
        reads = draft.step_reads(params, cfg, draft_cfg, k, batch, positions, cache_itemsize)
    draft_groups = {d.params_group for d in DRAFTS.values() if d.params_group is not None}
    target_weights = target_experts = 0.0
    draft_weights = reads.weights
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        size = nbytes(leaf)
        group = names[0]
        if group in draft_groups:  # the running draft's bytes are its step_reads
            continue
        if group == "embed" and not tied:  # looked up by row: the target's tokens and the draft's
            row = size / leaf.shape[0]
            target_weights += row * min(verified, leaf.shape[0])
            draft_weights += row * sum(min(n, leaf.shape[0]) for n in reads.target_embedding_rows)
        elif moe and is_routed_expert(names):
            target_experts += size * expected_experts(verified, e, top_k) / e
        else:  # the rest, the tied embedding (the output head) whole
            target_weights += size
    head = params["lm_head" if not tied else "embed"]
    head_bytes = cfg.hidden_size * cfg.vocab_size * jnp.dtype(head.dtype).itemsize
    kv = positions * target_for(cfg).cache_bytes_per_token(cfg, cache_itemsize) + reads.kv
    return StepBytes(
        target_weights=target_weights,
        target_experts=target_experts,
        draft_weights=draft_weights,
        draft_experts=reads.experts,
        draft_heads=reads.heads + reads.target_head_passes * head_bytes,
        kv=float(kv),
    )


def draft_method(cfg: Any, draft_cfg: Any) -> str | None:
    """The draft that speculates for target ``cfg`` when none is named: the registered draft whose
    ``config_class`` the separately loaded draft's config is, else the one the target's checkpoint
    carries (``Target.own_draft``: DeepSeek-V3's MTP layer), else None."""
    from mtp_jax.drafts import draft_for_config
    from mtp_jax.targets import target_for

    return target_for(cfg).own_draft(cfg) if draft_cfg is None else draft_for_config(draft_cfg).name


def random_params(cfg: Any, dtype: Any, weights: str, *, seed: int = 0, draft_cfg: Any = None) -> dict:
    """Parameters of ``cfg`` with random values, made on the device (nothing read from disk): the
    structure, shapes and dtypes the loader produces (:func:`mtp_jax.plan.abstract_params`): every
    weight in ``dtype`` with ``weights="dense"``, projections kept FP8 with ``weights="fp8"``.
    Projections are N(0, 0.02) (FP8: N(0, 1) values with block scales 0.02), norms 1, router biases
    0: the activations stay finite, which is all a timing needs. ``draft_cfg``: an EAGLE-3 or
    DFlash draft's config (captured layers resolved), whose random (dense) weights are added as the
    loader adds a draft model; its draft-to-target vocabulary map is the first target ids."""
    from mtp_jax.plan import abstract_params
    from mtp_jax.sharding import make_mesh

    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {WEIGHT_CHOICES}, got {weights!r}")
    mesh = make_mesh(devices=jax.devices()[:1])
    shapes = abstract_params(
        cfg,
        mesh,
        dtype,
        weights="fp8" if weights == "fp8" else "bf16",
        mtp=draft_cfg is None,  # a separate draft replaces the MTP layer (11 GB of FP8 for V3)
        draft_cfg=draft_cfg,
    )
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    key = jax.random.key(seed)
    leaves = []
    for i, (path, s) in enumerate(flat):  # one leaf at a time: a full-size temporary stays one leaf's
        name = path_names(path)[-1]
        kind = "ones" if name.endswith("norm") else name if name in ("bias", "scale_inv") else "normal"
        if jnp.issubdtype(s.dtype, jnp.integer):  # EAGLE-3's draft_to_target
            kind = "ids"
        leaves.append(_random_leaf(jax.random.fold_in(key, i), kind=kind, shape=s.shape, dtype=s.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnames=("kind", "shape", "dtype"))
def _random_leaf(key: jax.Array, *, kind: str, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "bias":
        return jnp.zeros(shape, dtype)
    if kind == "scale_inv":
        return jnp.full(shape, 0.02, dtype)
    if kind == "ids":
        return jnp.arange(math.prod(shape), dtype=dtype).reshape(shape)
    narrow = jnp.dtype(dtype).itemsize <= 2  # draw 16-bit values: half the temporary of float32
    x = jax.random.normal(key, shape, jnp.bfloat16 if narrow else dtype)
    return (x * (1.0 if jnp.dtype(dtype).itemsize == 1 else 0.02)).astype(dtype)


def time_step(
    params: dict,
    cfg: Any,
    *,
    k: int,
    batch: int,
    context: int,
    page_size: int,
    dtype: Any,
    iters: int,
    draft_cfg: Any = None,
    profile_dir: str | None = None,
    draft: str | None = None,
    memory: dict | None = None,
    lora_slots: Any = None,
    logprobs: bool = False,
    tree: Any = None,
    host: dict | None = None,
    window_cache: str = "pages",
    drafts: int | None = None,
) -> float:
    """Median seconds of one jitted speculative step (plain decoding for k = 0) of ``batch`` active
    rows whose committed length is ``context``: every timed call starts from that length. Drafts
    from the MTP layer, or from the EAGLE-3 or DFlash draft of ``draft_cfg``. ``profile_dir``:
    afterwards, trace :data:`PROFILED_STEPS` more steps there with :mod:`jax.profiler`. ``memory``:
    filled with the compiled step's memory analysis (bytes of temporaries, arguments, outputs), read
    before the first call, so it is there even when running the step runs out of memory.
    ``lora_slots`` [batch]: the rows' LoRA adapter slots (params holding adapters). ``logprobs``: the
    step's program that also returns log-probabilities (what runs while a request asks). ``tree``:
    verify that :class:`mtp_jax.tree.TokenTree` instead (``k`` must be its draft nodes). Each
    timed call starts with ``drafts`` (None: K) drafts in every row (:func:`timed_call_state`); 0
    times the step of a draft that proposes per row when no row has a proposal. ``host``: filled with
    ``dispatch_seconds``, the median host time of a timed call until it returns (the device runs on
    behind it): where it nears the step's time, the host's dispatch, not the device, sets the pace
    (it grows with the parameters' leaves: per-layer buffers have ~9 a layer)."""
    from mtp_jax.step import StepConfig, step

    draft = None if not k else (draft or draft_method(cfg, draft_cfg))
    sc = StepConfig(
        cfg, page_size, k, draft, draft_cfg=draft_cfg if k else None, logprobs=logprobs, tree=tree
    )
    sc = _with_window_cache(sc, window_cache)
    state = _timed_state(sc, batch, context, dtype, lora_slots)
    # The state is donated, seq_len with it: one committed-length buffer per call, made before timing
    calls = 2 + TIMED_ROUNDS * iters + PROFILED_STEPS
    lengths = [jnp.full((batch,), context, jnp.int32) for _ in range(calls)]
    counts = [jnp.full((batch,), k if drafts is None else drafts, jnp.int32) for _ in range(calls)]
    holder = [state]
    compiled = step.lower(params, state, sc).compile()  # compiled once, called below
    if memory is not None:
        analysis = compiled.memory_analysis()
        if analysis is not None:  # None where the backend does not say
            memory.update(
                temp_bytes=int(analysis.temp_size_in_bytes),
                argument_bytes=int(analysis.argument_size_in_bytes),
                output_bytes=int(analysis.output_size_in_bytes),
            )

    dispatch: list[float] = []

    def one() -> jax.Array:
        # feed back the new state, with the committed length reset
        s = timed_call_state(holder[0], seq_len=lengths.pop(), num_drafts=counts.pop())
        t0 = time.perf_counter()
        emitted, n_emit, holder[0], _logprobs = compiled(params, s)
        dispatch.append(time.perf_counter() - t0)
        return n_emit

    # Dispatched back to back, as the engine does (it reads a step's tokens one step late).
    seconds = timed_back_to_back([one], iters, rounds=TIMED_ROUNDS)
    if host is not None:
        host["dispatch_seconds"] = statistics.median(dispatch[2:])  # the timed calls
    if profile_dir is not None:
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(PROFILED_STEPS):
                jax.block_until_ready(one())
    return seconds


def _with_window_cache(sc: Any, window_cache: str) -> Any:
    """``sc`` with its sliding-window layers' rings for ``window_cache="ring"`` (mtp_jax.load's)."""
    from mtp_jax.step import with_ring

    if window_cache != "ring":
        return sc
    try:
        return with_ring(sc)
    except ValueError as e:
        raise ValueError(f"--window-cache ring: {e}") from None


PROFILED_STEPS = 3
TIMED_ROUNDS = 5


def device_op_times(profile_dir: str, steps: int = PROFILED_STEPS) -> list[dict]:
    """The operations of a :func:`jax.profiler.trace` in ``profile_dir`` (its newest Perfetto trace),
    costliest first: ``{"name", "us_per_step", "calls_per_step", "share"}``, durations summed per
    name and divided by ``steps``. On a GPU the device's kernels (its streams); elsewhere the
    host-side XLA operations (events carrying an ``hlo_op``). ``share``: of the summed durations."""
    import glob
    import gzip

    paths = glob.glob(os.path.join(profile_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {profile_dir}")
    with gzip.open(max(paths, key=os.path.getmtime), "rt", encoding="utf-8") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    names = {
        e.get("pid"): str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    devices = {pid for pid, name in names.items() if "/device:" in name}
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if devices and e.get("pid") not in devices:
            continue
        if not devices and "hlo_op" not in e.get("args", {}):
            continue
        entry = totals.setdefault(str(e.get("name")), [0.0, 0])
        entry[0] += float(e["dur"])
        entry[1] += 1
    whole = sum(t for t, _ in totals.values()) or 1.0
    rows = [
        {"name": n, "us_per_step": t / steps, "calls_per_step": c / steps, "share": t / whole}
        for n, (t, c) in totals.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _load_config(path: str, overrides: Sequence[str]) -> Any:
    from mtp_jax.config import parse_config

    return parse_config(_read_overridden(path, overrides))


def _config_name(path: str) -> str:
    """A config file's name for reports: its folder's for a checkpoint's config.json."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if base == "config.json" else base


def _read_overridden(path: str, overrides: Sequence[str], flag: str = "--set") -> dict:
    """A config.json with ``KEY=VALUE`` overrides (JSON values, given with ``flag``) applied."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            raw[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {key}: value {value!r} is not JSON ({e.msg})") from None
    return raw


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    """--window-cache and --layer-buffers: how the model keeps its cache and weights."""
    parser.add_argument(
        "--window-cache",
        choices=["pages", "ring"],
        default="pages",
        help="a sliding-window model's local layers: every page, or each slot's ring (mtp_jax.load's "
        "window_cache; the bytes and roofline columns still count every page)",
    )
    parser.add_argument(
        "--layer-buffers",
        choices=["auto", "on", "off"],
        default="auto",
        help="one buffer per layer's weights (read in place by unrolled layers) or the scanned stacks "
        "(auto: per-layer for layers of 4 MiB and more; mtp_jax.model.resolve_layer_buffers)",
    )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    src.add_argument("--config", help="config.json: random weights of that shape, made on the device")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a --config field (JSON value)",
    )
    parser.add_argument(
        "--weights", choices=WEIGHT_CHOICES, default="dense", help="--config only: dense (in --dtype) or FP8"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="parameter and cache dtype (default: float32 for --model, bfloat16 for --config)",
    )
    parser.add_argument(
        "--draft-model",
        help="--model only: an EAGLE-3 or DFlash draft directory (drafts from it, not from MTP)",
    )
    parser.add_argument(
        "--draft-config",
        help="--config only: an EAGLE-3 or DFlash draft's config.json, random weights (drafts from it)",
    )
    parser.add_argument(
        "--draft-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a --draft-config field (JSON value)",
    )
    parser.add_argument(
        "--draft",
        help="a registered draft method by name (e.g. ngram: no weights); default: the --draft-model's or "
        "--draft-config's, else the MTP layer",
    )
    _add_layout_args(parser)
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="also trace a few steps of each K with jax.profiler into DIR/k<K> and print the costliest "
        "device operations",
    )
    parser.add_argument(
        "--logprobs",
        action="store_true",
        help="also time each K's step with log-probabilities (the program that runs while a request asks "
        "for them), alternating with the plain one three times",
    )
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 3], help="drafts per step (0: plain)")
    parser.add_argument(
        "--tree",
        nargs="+",
        default=[],
        metavar="DEPTH,TOPK,NODES[,dynamic]",
        help="also time a step verifying each token tree (a chained draft: MTP, EAGLE-3, the draft model; "
        "dynamic: EAGLE-2's, each row's shape chosen by the draft inside the step), after the K rows",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024, help="committed tokens per row")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--copy-mb", type=int, default=1024, help="buffer size of the bandwidth measurements")
    parser.add_argument("--json", help="write the results here")
    return parser


def run(args: argparse.Namespace) -> dict:
    from mtp_jax.bench import machine_info
    from mtp_jax.model import DTYPES

    _check_args(args)
    cfg, params, draft_cfg, buffered, name, dtype_name = _roofline_model(args)
    method = _check_draft(args, cfg, params, draft_cfg, name)
    if args.window_cache == "ring":  # refused before the bandwidth runs, not after
        from mtp_jax.model import check_window_cache

        try:
            check_window_cache(cfg, "ring")
        except ValueError as e:
            raise ValueError(f"--window-cache ring: {e}") from None
    dtype = DTYPES[dtype_name]
    copy = copy_bandwidth(args.copy_mb, min(args.iters, 20))
    read = read_bandwidth(args.copy_mb, min(args.iters, 20))
    bandwidth = max(copy, read)
    print(
        f"device {jax.devices()[0]}: copy {copy / 1e9:.1f} GB/s, matrix-vector read {read / 1e9:.1f} GB/s",
        file=sys.stderr,
        flush=True,
    )
    rows = [_time_k(args, params, cfg, k, dtype, draft_cfg, method, bandwidth) for k in args.k]
    for spec in args.tree:  # each tree's step: K is its draft nodes
        from mtp_jax.request import token_tree
        from mtp_jax.tree import tree_setting

        tree = token_tree(tree_setting(spec))
        row = _time_k(args, params, cfg, tree.size - 1, dtype, draft_cfg, method, bandwidth, tree=tree)
        rows.append({**row, "tree": spec})
    return {
        "model": name,
        "dtype": dtype_name,
        "batch": args.batch,
        "context": args.context,
        "page_size": args.page_size,
        "iters": args.iters,
        "copy_bandwidth_gb_s": copy / 1e9,
        "read_bandwidth_gb_s": read / 1e9,
        "bandwidth_limit_gb_s": bandwidth / 1e9,
        "layer_buffers": buffered,
        "window_cache": args.window_cache,
        **machine_info(),
        "results": rows,
    }


def _check_args(args: argparse.Namespace) -> None:
    if min(args.batch, args.context, args.iters, args.page_size, args.copy_mb) < 1 or min(args.k) < 0:
        raise ValueError("--batch, --context, --iters, --page-size and --copy-mb must be >= 1, --k >= 0")
    if args.set and not args.config:
        raise ValueError("--set changes a --config; it does nothing to a checkpoint")
    if args.draft_model and args.config:
        raise ValueError("--draft-model goes with --model (a trained draft beside its target)")
    if args.draft_config and not args.config:
        raise ValueError("--draft-config goes with --config (random weights for both)")
    if args.draft_set and not args.draft_config:
        raise ValueError("--draft-set changes a --draft-config")


def _roofline_model(args: argparse.Namespace) -> tuple:
    """(config, params, draft config, layer buffers on, name, dtype name): random weights for a
    --config, or a checkpoint loaded (with its --draft-model)."""
    from mtp_jax.model import DTYPES

    draft_cfg = None
    layer_buffers = {"auto": None, "on": True, "off": False}[args.layer_buffers]
    if args.config:
        from mtp_jax.drafts import parse_draft_config
        from mtp_jax.model import resolve_layer_buffers, with_layer_buffers

        dtype_name = args.dtype or "bfloat16"
        cfg = _load_config(args.config, args.set)
        name = f"{_config_name(args.config)} {' '.join(args.set)} ({args.weights}, random)".strip()
        if args.draft_config:
            draft_raw = _read_overridden(args.draft_config, args.draft_set, "--draft-set")
            draft_cfg = parse_draft_config(draft_raw, cfg.num_hidden_layers, target_vocab_size=cfg.vocab_size)
            name += f" + {_config_name(args.draft_config)} {' '.join(args.draft_set)}".rstrip()
        print(f"random {args.weights} weights for {name} ...", file=sys.stderr, flush=True)
        params = random_params(cfg, DTYPES[dtype_name], args.weights, draft_cfg=draft_cfg)
        buffered = resolve_layer_buffers(params, cfg, None, layer_buffers)
        if buffered:
            params = with_layer_buffers(params, cfg, consume=True)  # ours alone: no second copy
    else:
        import mtp_jax
        from mtp_jax.bench import model_path

        dtype_name = args.dtype or "float32"
        path = model_path(args.model)
        model = mtp_jax.load(
            path, dtype=dtype_name, draft_model=args.draft_model, layer_buffers=layer_buffers
        )
        cfg, params, buffered = model.config, model.params, model.layer_buffers
        name = os.path.basename(os.path.abspath(path))
        if args.draft_model:
            draft_cfg = model.draft_config
            name += f" + {os.path.basename(os.path.abspath(args.draft_model))}"
    return cfg, params, draft_cfg, buffered, name, dtype_name


def _check_draft(args: argparse.Namespace, cfg: Any, params: Any, draft_cfg: Any, name: str) -> str | None:
    """The draft method timed (None: no draft); refuses a K > 0 no draft can run."""
    from mtp_jax.drafts import DRAFTS

    if args.draft is not None:
        if args.draft not in DRAFTS:
            raise ValueError(
                f"--draft {args.draft!r} is not a draft method; choose one of {', '.join(DRAFTS)}"
            )
        if DRAFTS[args.draft].config_class is not None and draft_cfg is None:
            raise ValueError(f"--draft {args.draft} needs its weights: --draft-model or --draft-config")
    method = args.draft or draft_method(cfg, draft_cfg)
    if max(args.k) and (method is None or DRAFTS[method].available(params, cfg) is not None):
        why = "it has no draft of its own" if method is None else DRAFTS[method].available(params, cfg)
        raise ValueError(f"{name}: {why}; only --k 0 can run (or give --draft-model, or --draft ngram)")
    if args.context + 2 * (max(args.k) + 1) > cfg.max_position_embeddings:
        raise ValueError(
            f"--context {args.context} plus the step's rows exceeds max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )
    return method


def _time_k(
    args: argparse.Namespace,
    params: Any,
    cfg: Any,
    k: int,
    dtype: Any,
    draft_cfg: Any,
    method: str | None,
    bandwidth: float,
    tree: Any = None,
) -> dict:
    """One K's row: the step timed (with log-probabilities, and with no draft, when asked), its
    bytes against the roofline, the profile's costliest operations; with ``tree``, the step that
    verifies that token tree (K: its draft nodes)."""
    from mtp_jax.drafts import DRAFTS

    print(f"K = {k}: compiling and timing ...", file=sys.stderr, flush=True)
    need = step_bytes(
        params,
        cfg,
        k=k,
        batch=args.batch,
        context=args.context,
        cache_itemsize=jnp.dtype(dtype).itemsize,
        draft_cfg=draft_cfg,
        draft=args.draft,
    )
    memory: dict = {}
    host: dict = {}
    kw = dict(k=k, batch=args.batch, context=args.context, page_size=args.page_size, dtype=dtype)
    kw.update(
        iters=args.iters, draft_cfg=draft_cfg, draft=args.draft, tree=tree, window_cache=args.window_cache
    )
    try:
        profile_dir = None if args.profile is None else os.path.join(args.profile, f"k{k}")
        seconds = time_step(params, cfg, profile_dir=profile_dir, memory=memory, host=host, **kw)
    except jax.errors.JaxRuntimeError as e:  # out of memory: report it, go on with the next K
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        first = str(e).strip().splitlines()[0][:300]
        print(f"K = {k}: {first}", file=sys.stderr, flush=True)
        return {"k": k, "error": first, "bytes": need.total, **memory}
    extra = {}
    if args.logprobs:  # alternated with the step without, in this process: the ratio is what counts
        pairs = [
            (time_step(params, cfg, **kw), time_step(params, cfg, logprobs=True, **kw)) for _ in range(3)
        ]
        plain, with_lp = (float(np.median(x)) for x in zip(*pairs, strict=True))
        extra = {"alternated_step_ms": plain * 1e3, "logprobs_step_ms": with_lp * 1e3}
        print(f"K = {k}: with log-probabilities {with_lp * 1e3:.3f} ms against {plain * 1e3:.3f} ms "
              f"({with_lp / plain:.2f}x)", file=sys.stderr, flush=True)  # fmt: skip
    if k and tree is None and DRAFTS[method].proposes_per_row:  # what a step without any match costs
        none = time_step(params, cfg, drafts=0, **kw)
        extra["no_match_step_ms"] = none * 1e3
        print(
            f"K = {k}: a step in which no row has a draft {none * 1e3:.3f} ms",
            file=sys.stderr,
            flush=True,
        )
    roofline = need.total / bandwidth
    ops = [] if args.profile is None else _profile_top(args.profile, k, seconds)
    return {
        "k": k,
        "draft": None if not k else (args.draft or draft_method(cfg, draft_cfg)),
        "step_ms": seconds * 1e3,
        "dispatch_ms": host["dispatch_seconds"] * 1e3,
        "bytes": need.total,
        "bytes_by_part": dataclasses.asdict(need),
        "roofline_ms": roofline * 1e3,
        "over_roofline": seconds / roofline,
        "achieved_gb_s": need.total / seconds / 1e9,
        **memory,
        **extra,
        **({"profile_top": ops} if ops else {}),
    }


def _profile_top(profile: str, k: int, seconds: float) -> list[dict]:
    """The costliest operations of K's profiled steps, printed and returned."""
    ops = device_op_times(os.path.join(profile, f"k{k}"))[:PROFILE_TOP]
    print(f"K = {k}: costliest operations per step (of {seconds * 1e6:.0f} us):", file=sys.stderr)
    for op in ops:
        print(
            f"  {op['us_per_step']:9.1f} us {100 * op['share']:5.1f}% x{op['calls_per_step']:<4g} "
            f"{op['name'][:100]}",
            file=sys.stderr,
            flush=True,
        )
    return ops


def table(report: dict) -> str:
    lines = [
        "| K | step ms | MB read | of which weights / experts / heads / KV | roofline ms | step / roofline "
        "| temporaries MB | host dispatch ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        temp = f"{r['temp_bytes'] / 1e6:.1f}" if "temp_bytes" in r else "-"
        if "error" in r:
            lines.append(f"| {r['k']} | {r['error'][:120]} | {r['bytes'] / 1e6:.1f} | | | | {temp} | |")
            continue
        p = r["bytes_by_part"]
        split = " / ".join(
            f"{x / 1e6:.1f}"
            for x in (
                p["target_weights"] + p["draft_weights"],
                p["target_experts"] + p["draft_experts"],
                p["draft_heads"],
                p["kv"],
            )
        )
        label = f"{r['k']} (tree {r['tree']})" if "tree" in r else r["k"]
        lines.append(
            f"| {label} | {r['step_ms']:.3f} | {r['bytes'] / 1e6:.1f} | {split} | "
            f"{r['roofline_ms']:.3f} | {r['over_roofline']:.1f}x | {temp} | {r['dispatch_ms']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        report = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{report['model']}, batch {report['batch']}, context {report['context']}, {report['dtype']}, "
        f"{'per-layer weight buffers' if report['layer_buffers'] else 'scanned layer stacks'}, "
        f"bandwidth limit {report['bandwidth_limit_gb_s']:.1f} GB/s "
        f"(copy {report['copy_bandwidth_gb_s']:.1f}, matrix-vector {report['read_bandwidth_gb_s']:.1f}) "
        f"on {report['device']}"
    )
    print(table(report))
    if args.json:
        from mtp_jax.bench import write_json

        write_json(args.json, report)
    return 0
