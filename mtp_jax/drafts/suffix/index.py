"""The suffix draft's engine-wide index of finished outputs: counted on the host when a request
finishes, mirrored into a fixed-size table on the device that the step looks up.

Host side (:class:`SuffixIndex`): for every position of a finished request's output, each context
of ``min_match..index_match`` tokens before it (the prompt's last tokens included) counts the
``INDEX_DEPTH`` tokens that followed, per tenant (the scheduler's number for the request's cache
salt and LoRA adapter). The last ``index_outputs`` outputs are remembered; the oldest are
uncounted as new ones arrive. Device side (:func:`empty_index`): ``index_slots`` entries, each
one context of one tenant (its tokens newest first, its length, the tenant) with its
``index_paths`` most frequent continuations and their counts; a context's entry sits at its hash
(:func:`mtp_jax.drafts.suffix.tree.host_key`) modulo the table, and of two contexts hashed to one
entry the one seen more often keeps it. Updates are written between steps by one small jitted
scatter, dispatched after the step in flight like any other call, so the device never waits for
the host. Every process of a multi-host run finishes the same requests in the same order and
builds the same table.
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.drafts.suffix.config import SuffixConfig
from mtp_jax.drafts.suffix.tree import host_key

INDEX_DEPTH = 16
"""Tokens of each continuation the index keeps (a tree deeper than this reads no further)."""


def empty_index(cfg: SuffixConfig) -> dict:
    """The device table, empty ({} with the index off): context [H, M] int32 (-1 past its
    length), length [H] (0: empty), tenant [H], continuation [H, G, INDEX_DEPTH] (-1 past its end),
    count [H, G] float32 (0: none)."""
    if not cfg.indexed:
        return {}
    h, m, g = cfg.index_slots, cfg.index_match, cfg.index_paths
    return {
        "context": jnp.full((h, m), -1, jnp.int32),
        "length": jnp.zeros((h,), jnp.int32),
        "tenant": jnp.zeros((h,), jnp.int32),
        "continuation": jnp.full((h, g, INDEX_DEPTH), -1, jnp.int32),
        "count": jnp.zeros((h, g), jnp.float32),
    }


@functools.partial(jax.jit, donate_argnums=(0,))
def _write(index: dict, slots: jax.Array, rows: dict) -> dict:
    return {name: index[name].at[slots].set(rows[name], mode="drop") for name in index}


Key = tuple[int, tuple[int, ...]]  # (tenant, context newest first)


class SuffixIndex:
    """The host's counts and the updates they owe the device table (one per engine)."""

    def __init__(self, cfg: SuffixConfig) -> None:
        self.cfg = cfg
        self.counts: dict[Key, collections.Counter] = {}
        self.outputs: collections.deque[tuple[int, tuple[int, ...], int]] = collections.deque()
        self.owner: dict[int, Key] = {}  # device entry -> the context it holds
        self.dirty: set[Key] = set()
        self.stats = {"outputs": 0, "forgotten": 0, "entries_written": 0}

    def finished(self, prompt: Sequence[int], output: Sequence[int], tenant: int) -> None:
        """Count a finished request's ``output`` (after ``prompt``) for ``tenant``."""
        if not output:
            return
        text = tuple(int(t) for t in prompt[-self.cfg.index_match :]) + tuple(int(t) for t in output)
        start = len(text) - len(output)
        self._count(text, start, tenant, 1)
        self.outputs.append((tenant, text, start))
        self.stats["outputs"] += 1
        while len(self.outputs) > self.cfg.index_outputs:
            old_tenant, old_text, old_start = self.outputs.popleft()
            self._count(old_text, old_start, old_tenant, -1)
            self.stats["forgotten"] += 1

    def _count(self, text: tuple[int, ...], start: int, tenant: int, sign: int) -> None:
        lo, hi = self.cfg.min_match, self.cfg.index_match
        for i in range(max(start, 1), len(text)):
            after = text[i : i + INDEX_DEPTH]
            for m in range(lo, min(hi, i) + 1):
                key = (tenant, text[i - m : i][::-1])
                counter = self.counts.setdefault(key, collections.Counter())
                counter[after] += sign
                if counter[after] <= 0:
                    del counter[after]
                    if not counter:
                        del self.counts[key]
                self.dirty.add(key)

    def _total(self, key: Key | None) -> int:
        counter = self.counts.get(key) if key is not None else None
        return 0 if not counter else sum(counter.values())

    def updates(self) -> tuple[np.ndarray, dict] | None:
        """The device entries the counts changed since the last call: (slots [u], their rows), or
        None when none did."""
        if not self.dirty:
            return None
        cfg, written = self.cfg, {}
        for key in sorted(self.dirty, key=lambda k: (k[0], len(k[1]), k[1])):
            slot = host_key(key[1], key[0]) & (cfg.index_slots - 1)
            owner = self.owner.get(slot)
            if owner == key or self._total(key) >= self._total(owner):
                if self._total(key):
                    self.owner[slot] = key
                elif owner == key:
                    del self.owner[slot]
                written[slot] = self.owner.get(slot)
        self.dirty.clear()
        self.stats["entries_written"] += len(written)
        return self._rows(written)

    def _rows(self, written: dict[int, Key | None]) -> tuple[np.ndarray, dict]:
        cfg = self.cfg
        u = max(16, 1 << (len(written) - 1).bit_length())  # a few update shapes: a few programs
        slots = np.full(u, cfg.index_slots, np.int32)  # padding: out of range, dropped
        rows = {
            "context": np.full((u, cfg.index_match), -1, np.int32),
            "length": np.zeros(u, np.int32),
            "tenant": np.zeros(u, np.int32),
            "continuation": np.full((u, cfg.index_paths, INDEX_DEPTH), -1, np.int32),
            "count": np.zeros((u, cfg.index_paths), np.float32),
        }
        for i, (slot, key) in enumerate(sorted(written.items())):
            slots[i] = slot
            if key is None:  # emptied
                continue
            tenant, context = key
            rows["context"][i, : len(context)] = context
            rows["length"][i], rows["tenant"][i] = len(context), tenant
            best = sorted(self.counts[key].items(), key=lambda kv: (-kv[1], kv[0]))[: cfg.index_paths]
            for j, (after, count) in enumerate(best):
                rows["continuation"][i, j, : len(after)] = after
                rows["count"][i, j] = count
        return slots, rows


def read_seed_file(path: str) -> list[tuple[list[int], list[int], bytes]]:
    """:meth:`Learner.seeds` of the JSON-lines file at ``path``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompt, output = record.get("prompt", []), record["output"]
                salt = record.get("cache_salt")
                ok = all(
                    isinstance(x, list) and all(isinstance(t, int) and t >= 0 for t in x)
                    for x in (prompt, output)
                )
                if not ok or not (salt is None or isinstance(salt, str)):
                    raise ValueError("prompt and output must be lists of token ids, cache_salt text")
            except (ValueError, KeyError, AttributeError) as e:
                raise ValueError(f"{path}, line {number}: not a suffix index seed ({e})") from None
            out.append((prompt, output, (b"" if salt is None else b"salt:" + salt.encode()) + b"lora:0"))
    return out


class Learner:
    """What a scheduler holds for a draft that learns from finished requests
    (:attr:`mtp_jax.drafts.base.Draft.learner`): ``finished`` counts one, ``apply`` writes what
    changed into the draft's device state."""

    def __init__(self, cfg: SuffixConfig, at: str | None = None) -> None:
        self.index = SuffixIndex(cfg)
        self.at = at  # the key of the suffix draft's state inside a composite draft's (a hybrid's)

    def finished(self, prompt: Sequence[int], output: Sequence[int], tenant: int) -> None:
        self.index.finished(prompt, output, tenant)

    def seeds(self) -> list[tuple[list[int], list[int], bytes]]:
        """The outputs of ``index_seed`` (a JSON-lines file of {"prompt": ids, "output": ids,
        "cache_salt": optional text}) as (prompt, output, salt), the salt as the scheduler names a
        request's (its cache salt, no adapter), for the scheduler to count under each one's tenant
        before the first request; [] without one. ValueError naming the line of a bad record."""
        path = self.index.cfg.index_seed
        return [] if path is None else read_seed_file(path)

    def stats(self) -> dict:
        """Outputs indexed and forgotten, contexts counted, device entries written."""
        return {**self.index.stats, "contexts": len(self.index.counts)}

    def apply(self, draft_state: dict) -> dict:
        """``draft_state`` with the index's pending updates written (unchanged without any)."""
        pending = self.index.updates()
        if pending is None:
            return draft_state
        slots, rows = pending
        if self.at is not None:
            return {**draft_state, self.at: self.apply_to(draft_state[self.at], slots, rows)}
        return self.apply_to(draft_state, slots, rows)

    @staticmethod
    def apply_to(state: dict, slots, rows) -> dict:
        return {**state, "index": _write(state["index"], slots, rows)}
