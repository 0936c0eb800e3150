"""Automatic speculation length: how many drafts a step should verify at a given batch size.

Speculation trades verification work (B x (K+1) tokens a step) for accepted drafts. Where a step's
cost grows with its tokens (a busy batch, a CPU) the best K falls, down to none. ``mtp-jax bench
--auto-k-table FILE`` measures plain decoding and each K at each batch size on this device and
writes the best K per batch size; ``generate(..., auto_k=FILE)`` (CLI ``--auto-k FILE``) caps K
with it. The batch size is the number of slots a step computes: the compiled step computes every
slot whatever its state, so idle slots do not make speculation cheaper.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from mtp_jax.errors import InvalidRequestError
from mtp_jax.schedule import SpsTable

FORMAT = "mtp-jax-auto-k/1"


class AutoK:
    """A measured table batch size -> best K (0 = plain decoding), for one draft method.

    Batch sizes between measured ones use the largest measured batch below them (beyond the
    table's range, its nearest end)."""

    def __init__(self, k_by_batch: Mapping[int, int], draft: str | None = None, source: str = "") -> None:
        where = f"auto-K table {source}".rstrip()
        table = {}
        for batch, k in k_by_batch.items():
            for name, v, least in (("batch size", batch, 1), ("K", k, 0)):
                if isinstance(v, bool) or not isinstance(v, int) or v < least:
                    raise InvalidRequestError(f"{where}: bad {name} {v!r}")
            table[batch] = k
        if not table:
            raise InvalidRequestError(f"{where} is empty")
        self.k_by_batch = dict(sorted(table.items()))
        self.draft = draft
        self.source = source

    def __call__(self, batch: int) -> int:
        below = [b for b in self.k_by_batch if b <= batch]
        return self.k_by_batch[below[-1] if below else min(self.k_by_batch)]

    @classmethod
    def load(cls, path: str | os.PathLike[str], draft: str) -> AutoK:
        """``draft``'s table from a file written by :func:`write` (``mtp-jax bench --auto-k-table``)."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError as e:
            raise InvalidRequestError(
                f"auto-K table {path} does not exist (mtp-jax bench --auto-k-table writes one)"
            ) from e
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"auto-K table {path} is not JSON: {e}") from e
        tables = raw.get("k_by_batch") if isinstance(raw, dict) else None
        if not isinstance(tables, dict) or raw.get("format") != FORMAT:
            raise InvalidRequestError(f"{path} is not an auto-K table (format {FORMAT!r} with k_by_batch)")
        if draft not in tables or not isinstance(tables[draft], dict):
            measured = ", ".join(map(repr, tables)) or "none"
            raise InvalidRequestError(f"auto-K table {path} was measured for draft {measured}, not {draft!r}")
        try:
            table = {int(b): k for b, k in tables[draft].items()}
        except ValueError as e:
            raise InvalidRequestError(f"auto-K table {path}: batch sizes must be integers") from e
        return cls(table, draft, path)

    @classmethod
    def coerce(cls, value: object, draft: str) -> AutoK:
        """``draft``'s AutoK from a table, a path to a table file or a mapping batch size -> K."""
        if isinstance(value, AutoK):
            if value.draft is not None and value.draft != draft:
                raise InvalidRequestError(
                    f"auto-K table {value.source} was measured for draft {value.draft!r}, not {draft!r}"
                )
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls.load(value, draft)
        if isinstance(value, Mapping):
            return cls(dict(value), draft)
        raise InvalidRequestError(
            f"auto_k must be a table file, a {{batch size: K}} mapping or None, got {value!r}"
        )


def best_k(rows: list[dict]) -> dict[str, dict[int, int]]:
    """From ``mtp-jax bench`` result rows, per draft method the K with the highest decode rate at
    each batch size, plain decoding (K = 0) included. Rows at a DFlash block size other than the
    trained one and automatic-K rows are left out (a table is for the draft as trained)."""
    plain = {r["batch"]: r["decode_tok_s"] for r in rows if not r["k"] and not r.get("auto_k")}
    best: dict[str, dict[int, tuple[float, int]]] = {}
    for r in rows:
        chosen_block = "block_size" in r and r["block_size"] != r.get("trained_block_size")
        if not r["k"] or chosen_block or r.get("auto_k") or r["batch"] not in plain:
            continue
        table = best.setdefault(r["draft"], {})
        rate, _ = table.get(r["batch"], (plain[r["batch"]], 0))
        if r["decode_tok_s"] > rate:
            table[r["batch"]] = (r["decode_tok_s"], r["k"])
        else:
            table.setdefault(r["batch"], (rate, 0))
    return {draft: {b: k for b, (_, k) in sorted(t.items())} for draft, t in best.items()}


def write(path: str | os.PathLike[str], tables: Mapping[str, Mapping[int, int]], meta: dict) -> None:
    """Write tables {draft method: {batch size: K}} (temporary name, then rename)."""
    path = os.fspath(path)
    raw = {
        "format": FORMAT,
        **meta,
        "k_by_batch": {d: {str(b): k for b, k in t.items()} for d, t in tables.items()},
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def batch_controls(model: Any, speculative: Any) -> Callable[[int, Any], Any] | None:
    """What ``generate`` adjusts per batch size (:func:`mtp_jax.scheduler.generate`'s
    ``per_batch``): K capped by the speculative config's ``auto_k`` table, then with
    ``schedule="confidence"`` the steps/s at each width for that batch (its ``sps_table``, or
    measured on this device before the call starts, once per batch and K for the model), or plain
    decoding where the table says no width could beat it even with every draft accepted. None when
    neither applies."""
    auto = None if speculative.auto_k is None else AutoK.coerce(speculative.auto_k, speculative.draft)
    confidence = speculative.schedule == "confidence"
    if auto is None and not confidence:
        return None
    table = None if speculative.sps_table is None else SpsTable.load(speculative.sps_table)

    def adjust(batch: int, sc: Any) -> Any:
        if auto is not None and sc.tree is None:
            sc = dataclasses.replace(sc, k=min(sc.k, auto(batch)))
        if not confidence or sc.k == 0:
            return sc
        speeds = table or measured_sps(model, sc, batch)
        if not speeds.speculation_can_pay(batch, sc.k):  # not even with every draft accepted
            return sc.variant(0, draft=None)
        return dataclasses.replace(sc, schedule=speeds.for_batch(batch, sc.k))

    return adjust


def measured_sps(model: Any, sc: Any, batch: int, context: int = 256, iters: int = 4) -> SpsTable:
    """The model's SPS table for ``sc``'s draft and K at ``batch``, measured on this device at a
    committed length of ``context`` (:func:`mtp_jax.timing.sps_table`; progress on stderr) and
    kept on the model for later calls."""
    from mtp_jax.timing import sps_table

    cache = model.__dict__.setdefault("_sps_tables", {})
    key = (sc.draft, sc.k, sc.draft_cfg, batch)
    if key not in cache:
        widths = f"widths 1..{sc.k + 1}"
        print(f"schedule='confidence': measuring steps/s at {widths}, batch {batch}", file=sys.stderr)
        cache[key] = sps_table(
            model.params,
            sc.cfg,
            k=sc.k,
            batches=[batch],
            context=context,
            page_size=sc.page_size,
            dtype=jnp.dtype(model.dtype),
            iters=iters,
            draft=sc.draft,
            draft_cfg=sc.draft_cfg,
            progress=lambda line: print(line, file=sys.stderr),
        )
    return cache[key]
