"""A frozen target's outputs for draft training, computed once instead of at every step.

Training an EAGLE-3 or DFlash draft against a frozen target runs the target over every window of
every step to get the draft's input features and the teacher distribution. The target does not
change, so both can be computed once per token of the training stream and read back: on SmolLM2-135M
(2-core CPU, 8 x 256-token windows) the target's forward and head were about 40% of an EAGLE-3
step.

What is kept, per token r of the training stream (row r predicts token r + 1):

* ``features``: the draft's input features at r ([F], the concatenated captured layers; bfloat16
  by default, float32 on request);
* ``top_ids`` / ``top_logp``: the ``k`` most likely next tokens under the target and their
  log-probabilities (float32, sorted, most likely first). The teacher distribution a step trains on
  is the renormalised restriction of these to the draft's vocabulary (:func:`top_k_teacher`); with
  ``k`` = the vocabulary it is exact.

The target runs over each *segment* of the stream on its own, from position 0: for chat data a
segment is one conversation (prompt and reply, exactly what the target sees when serving), for
document data a piece of at most ``max_len`` tokens. A training window that starts inside a segment
therefore reads features computed with the segment's earlier context, as at inference time (the
live target, run on the window alone, saw none of it).

The cache is a directory of ``.npy`` files (memory-mapped when read), ``meta.json`` (what it was
built from: a cache of another target, feature set, ``k``, precision or data is refused by name)
and ``progress.json`` (batches done: a killed build resumes where it stopped and writes the same
bytes as an uninterrupted one). A finished cache whose data is a prefix of a run's, ending at a
conversation, grows: the conversations added after it are computed and the rest kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FORMAT = 1
FEATURE_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def stream_digest(stream: np.ndarray, starts: np.ndarray) -> str:
    """What identifies the data: the token stream and its segment starts."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(stream, np.int32).tobytes())
    h.update(np.ascontiguousarray(starts, np.int64).tobytes())
    return h.hexdigest()


def segments(length: int, starts: np.ndarray | None, max_len: int) -> list[tuple[int, int]]:
    """[start, end) pieces of a stream of ``length`` tokens: cut at ``starts`` (conversation
    boundaries; None: none), then every ``max_len`` tokens."""
    cuts = [0] if starts is None else sorted({0, *(int(s) for s in starts if 0 < s < length)})
    out = []
    for a, b in zip(cuts, [*cuts[1:], length], strict=True):
        out.extend((s, min(s + max_len, b)) for s in range(a, b, max_len))
    return out


def plan_batches(pieces: list[tuple[int, int]], bucket: int, max_len: int, token_budget: int) -> list[dict]:
    """Forward batches of segments of one padded length (the next multiple of ``bucket``), longest
    first, ``token_budget // length`` rows each (a bucket's last batch padded with empty rows, so
    each length compiles once). Deterministic: a resumed build makes the same batches."""
    by_len: dict[int, list[tuple[int, int]]] = {}
    for a, b in pieces:
        padded = min(max_len, -(-(b - a) // bucket) * bucket)
        by_len.setdefault(padded, []).append((a, b))
    batches = []
    for padded in sorted(by_len, reverse=True):
        rows = max(1, token_budget // padded)
        group = by_len[padded]
        batches.extend(
            {"length": padded, "rows": rows, "pieces": group[i : i + rows]}
            for i in range(0, len(group), rows)
        )
    return batches


@dataclass
class TargetCache:
    """A built cache, memory-mapped."""

    path: str
    features: np.ndarray  # [N, F]
    top_ids: np.ndarray  # [N, k] int32
    top_logp: np.ndarray  # [N, k] float32
    meta: dict

    @classmethod
    def open(cls, path: str) -> TargetCache:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        arrays = {
            n: np.load(os.path.join(path, f"{n}.npy"), mmap_mode="r")
            for n in ("features", "top_ids", "top_logp")
        }
        features = arrays["features"]
        if meta["feature_dtype"] == "bfloat16":  # stored as its bit pattern (.npy has no bfloat16)
            features = features.view(ml_dtypes.bfloat16)
        return cls(path, features, arrays["top_ids"], arrays["top_logp"], meta)

    def rows(self, starts: np.ndarray, length: int) -> dict[str, np.ndarray]:
        """Rows [s, s + length) for each start: features (float32) [b, length, F], top_ids and
        top_logp [b, length, k]."""
        take = lambda a: np.stack([np.asarray(a[s : s + length]) for s in starts])  # noqa: E731
        return {
            "features": take(self.features).astype(np.float32),
            "top_ids": take(self.top_ids),
            "top_logp": take(self.top_logp),
        }


def _check_meta(path: str, wanted: dict) -> None:
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        found = json.load(f)
    differ = [k for k in sorted(set(found) | set(wanted)) if found.get(k) != wanted.get(k)]
    if differ:
        detail = "; ".join(
            f"{k}: cache has {found.get(k)!r}, this run needs {wanted.get(k)!r}" for k in differ
        )
        raise SystemExit(
            f"target cache {path} was built for something else ({detail}); "
            "remove it or choose another directory"
        )


def _grows(path: str, meta: dict, stream: np.ndarray, starts: np.ndarray) -> bool:
    """Whether the cache at ``path`` holds a prefix of this data that ends at a segment start (more
    conversations added after the ones it has; everything else the same): it then grows instead
    of being refused."""
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        found = json.load(f)
    same = {k: v for k, v in meta.items() if k not in ("tokens", "data")}
    if any(found.get(k) != v for k, v in same.items()) or set(found) != set(meta):
        return False
    n = int(found["tokens"])
    if not n < len(stream) or n not in set(starts.tolist()):
        return False
    if found["data"] != stream_digest(stream[:n], starts[starts < n]):
        return False
    with open(os.path.join(path, "progress.json"), encoding="utf-8") as f:
        progress = json.load(f)
    offset = int(progress.get("from", 0))
    pieces = [p for p in segments(n, starts[starts < n], found["max_len"]) if p[0] >= offset]
    if int(progress["batches_done"]) < len(
        plan_batches(pieces, found["bucket"], found["max_len"], found["token_budget"])
    ):
        raise SystemExit(
            f"target cache {path} holds the first {n:,} tokens of this data but is not finished: "
            "finish it with the data it was built for (or remove it) before adding more"
        )
    return True


def _grow(path: str, meta: dict) -> None:
    """Make the cache's arrays ``meta["tokens"]`` rows long, keeping the rows it had, and mark the
    new rows to be computed. Safe to interrupt: the old meta stays until the arrays are in place,
    and growing again copies the same rows (the first ``tokens`` of the old meta)."""
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        had = int(json.load(f)["tokens"])
    print(f"target cache {path}: growing from {had:,} to {meta['tokens']:,} tokens", file=sys.stderr)
    for name in ("features", "top_ids", "top_logp"):
        final = os.path.join(path, f"{name}.npy")
        old = np.load(final, mmap_mode="r")
        tmp = final + ".grow.npy"
        new = np.lib.format.open_memmap(tmp, "w+", old.dtype, (meta["tokens"], *old.shape[1:]))
        for a in range(0, had, 1 << 16):  # in pieces: the features of a large cache are gigabytes
            new[a : min(a + (1 << 16), had)] = old[a : min(a + (1 << 16), had)]
        new.flush()
        del new, old
        os.replace(tmp, final)
    _write_json(os.path.join(path, "progress.json"), {"from": had, "batches_done": 0})
    _write_json(os.path.join(path, "meta.json"), meta)


def _create(path: str, meta: dict) -> None:
    """A new cache's files: zeroed memory-mapped arrays and progress, then meta.json last (its
    presence means the files exist)."""
    if os.path.exists(path) and os.listdir(path):
        raise SystemExit(f"target cache {path} exists and is not a target cache (no meta.json)")
    os.makedirs(path, exist_ok=True)
    rows, k = meta["tokens"], meta["k"]
    store = np.uint16 if meta["feature_dtype"] == "bfloat16" else np.float32
    shapes = {
        "features": ((rows, meta["feature_size"]), store),
        "top_ids": ((rows, k), np.int32),
        "top_logp": ((rows, k), np.float32),
    }
    for name, (shape, dtype) in shapes.items():
        np.lib.format.open_memmap(os.path.join(path, f"{name}.npy"), "w+", dtype, shape).flush()
    _write_json(os.path.join(path, "progress.json"), {"batches_done": 0})
    _write_json(os.path.join(path, "meta.json"), meta)


def _fill(
    path: str,
    forward: Callable[[dict, jax.Array], tuple[jax.Array, jax.Array]],
    params: dict,
    stream: np.ndarray,
    batches: list[dict],
    progress: dict,
    offset: int,
    stop_after: int | None,
    k: int,
    feature_dtype: str,
) -> bool:
    """Compute the cache's rows batch by batch from the ``batches_done`` recorded in ``progress``
    on, recording each finished batch; True when every batch is done (``stop_after``: at most that
    many in this call)."""
    progress_path = os.path.join(path, "progress.json")
    done = int(progress["batches_done"])
    arrays = {
        n: np.load(os.path.join(path, f"{n}.npy"), mmap_mode="r+")
        for n in ("features", "top_ids", "top_logp")
    }

    @jax.jit
    def run(params: dict, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        feats, logp = forward(params, tokens)
        top_logp, top_ids = jax.lax.top_k(logp.astype(jnp.float32), k)
        return feats.astype(FEATURE_DTYPES[feature_dtype]), top_ids.astype(jnp.int32), top_logp

    total = len(stream)
    covered = offset + sum(b - a for batch in batches[:done] for a, b in batch["pieces"])
    t0, first, last_print = time.perf_counter(), covered, 0.0
    end = len(batches) if stop_after is None else min(len(batches), done + stop_after)
    for i in range(done, end):
        batch = batches[i]
        tokens = np.zeros((batch["rows"], batch["length"]), np.int32)
        for r, (a, b) in enumerate(batch["pieces"]):
            tokens[r, : b - a] = stream[a:b]
        feats, top_ids, top_logp = jax.device_get(run(params, jnp.asarray(tokens)))
        if feature_dtype == "bfloat16":
            feats = feats.view(np.uint16)
        for r, (a, b) in enumerate(batch["pieces"]):
            arrays["features"][a:b] = feats[r, : b - a]
            arrays["top_ids"][a:b] = top_ids[r, : b - a]
            arrays["top_logp"][a:b] = top_logp[r, : b - a]
            covered += b - a
        for a in arrays.values():
            a.flush()
        _write_json(progress_path, {**progress, "batches_done": i + 1})
        now = time.perf_counter()
        if now - last_print >= 10 or i + 1 == len(batches):
            last_print = now
            rate = (covered - first) / max(now - t0, 1e-9)
            eta = (total - covered) / rate if rate else float("inf")
            print(
                f"target cache {path}: {covered:,}/{total:,} tokens, {rate:,.0f} tok/s, "
                f"ETA {eta / 60:.1f} min",
                file=sys.stderr,
                flush=True,
            )
    del arrays
    return end == len(batches)


def build(
    path: str,
    *,
    forward: Callable[[dict, jax.Array], tuple[jax.Array, jax.Array]],
    params: dict,
    stream: np.ndarray,
    starts: np.ndarray | None,
    identity: dict,
    feature_size: int,
    k: int = 32,
    feature_dtype: str = "bfloat16",
    max_len: int = 2048,
    bucket: int = 128,
    token_budget: int = 2048,
    stop_after: int | None = None,
) -> TargetCache | None:
    """Build (or finish, or just open) the cache at ``path`` for ``stream`` cut at ``starts``.

    ``forward(params, tokens [b, t]) -> (features [b, t, feature_size], log-probabilities [b, t,
    V])`` runs the frozen target from position 0 (jitted here; the parameters are an argument, so
    XLA does not fold a real model in as constants). ``identity`` names the target and the feature
    set; with ``k``, the precision, the data's digest and the cutting it must match an existing
    cache. ``stop_after`` batches (tests): returns None when the build is not complete."""
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature_dtype must be one of {sorted(FEATURE_DTYPES)}, got {feature_dtype!r}")
    stream = np.asarray(stream, np.int32)
    starts_arr = np.zeros(0, np.int64) if starts is None else np.asarray(starts, np.int64)
    meta = {
        "format": FORMAT,
        **identity,
        "k": int(k),
        "feature_dtype": feature_dtype,
        "feature_size": int(feature_size),
        "tokens": len(stream),
        "data": stream_digest(stream, starts_arr),
        "max_len": int(max_len),
        "bucket": int(bucket),
        "token_budget": int(token_budget),
    }
    progress_path = os.path.join(path, "progress.json")
    if os.path.isfile(os.path.join(path, "meta.json")):
        if _grows(path, meta, stream, starts_arr):
            _grow(path, meta)
        _check_meta(path, meta)
    else:
        _create(path, meta)
    with open(progress_path, encoding="utf-8") as f:
        progress = json.load(f)
    done, offset = int(progress["batches_done"]), int(progress.get("from", 0))
    pieces = segments(len(stream), None if starts is None else starts_arr, max_len)
    # the segments cover the whole stream; a grown cache computes those past what it had
    batches = plan_batches([(a, b) for a, b in pieces if a >= offset], bucket, max_len, token_budget)
    if done < len(batches) and not _fill(
        path, forward, params, stream, batches, progress, offset, stop_after, k, feature_dtype
    ):
        return None
    return TargetCache.open(path)


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp-write"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
