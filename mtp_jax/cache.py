"""Paged KV caches, target-independent parts: page allocation and slot arithmetic.

Device side a cache is whatever its model keeps per token (:attr:`mtp_jax.targets.base.Target.
init_cache`: DeepSeek-V3's latent rows, Llama's K/V heads), in pages of ``page_size`` positions, plus
a page table [B, pages_per_row] naming each row's pages in position order. Host side,
:class:`PageAllocator` hands pages out and takes them back.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class PageAllocator:
    """A free list of page ids. Pages are handed out in any order; the page table hides it."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV pages: need {n}, {len(self._free)} free of {self.num_pages}")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class ShardedPageAllocator:
    """Page ids split into ``shards`` equal contiguous ranges with a free list each. Under a mesh the
    caches are split by page over ``data`` and the rows by block (:mod:`mtp_jax.sharding`), so a row
    of data shard s that takes its pages from range s keeps its KV on the devices that hold it."""

    def __init__(self, num_pages: int, shards: int = 1) -> None:
        if shards < 1 or num_pages % shards:
            raise ValueError(f"{num_pages} pages do not split into {shards} equal shards")
        self.num_pages = num_pages
        self.shards = shards
        self.per_shard = num_pages // shards
        self._parts = [PageAllocator(self.per_shard) for _ in range(shards)]

    @property
    def free(self) -> int:
        return sum(part.free for part in self._parts)

    def free_in(self, shard: int) -> int:
        """Free pages of shard ``shard``."""
        return self._parts[shard].free

    def shard_of(self, page: int) -> int:
        """The shard whose range holds ``page``."""
        return page // self.per_shard

    def allocate(self, n: int, shard: int = 0) -> list[int]:
        base = shard * self.per_shard
        return [base + p for p in self._parts[shard].allocate(n)]

    def release(self, pages: list[int]) -> None:
        for shard, part in enumerate(self._parts):
            base = shard * self.per_shard
            mine = [p - base for p in pages if base <= p < base + self.per_shard]
            if mine:
                part.release(mine)


class PrefixCache:
    """Automatic prefix caching: requests whose prompts start with the same tokens share the cache
    pages of that prefix, over a :class:`ShardedPageAllocator` (or one shard of pages).

    A full page of a prompt is named by a chained SHA-256 digest: of the digest of the page before
    it (the first page's: of ``salt``, e.g. the LoRA adapter that computed it), its own tokens and
    the ``lookahead`` tokens after it (a draft whose cache entry at position p also depends on token
    p + 1: :attr:`mtp_jax.drafts.base.Draft.cache_lookahead`). Equal digests mean equal prefixes, so
    equal cache contents for every cache on the page table (the target's, the draft's). A request
    :meth:`take`-s the pages of its longest cached prefix (at least its last prompt token is always
    computed again: its logits give the first new token) and fresh pages for the rest;
    :meth:`register` names its prompt's full pages once its prefill is dispatched (and, when it
    finishes, the full pages of its prompt and reply: the next turn of a chat prefills only its new
    message); :meth:`release` gives its pages back. Pages are reference-counted: a named page nobody
    holds stays cached and is evicted, least recently released first, only when fresh pages run out.

    ``queries`` and ``hits`` count prompt tokens looked up and found (vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits``). Deterministic (no per-process hash seed), so
    every process of a multi-process run makes the same choices."""

    def __init__(self, allocator: ShardedPageAllocator, page_size: int, lookahead: int = 0) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.allocator, self.page_size, self.lookahead = allocator, page_size, lookahead
        self.shards = allocator.shards
        self._page_of: dict[tuple[int, bytes], int] = {}  # (shard, digest) -> page
        self._digest_of: dict[int, tuple[int, bytes]] = {}  # page -> its (shard, digest)
        self._refs: dict[int, int] = {}  # pages held, by how many requests
        self._idle = [collections.OrderedDict() for _ in range(self.shards)]  # named, unheld: LRU first
        self.queries = self.hits = 0

    @property
    def free(self) -> int:
        """Pages a request could take now: never handed out, or cached and held by nobody."""
        return self.allocator.free + sum(len(idle) for idle in self._idle)

    @property
    def cached(self) -> int:
        """Pages holding a named prefix (held or not)."""
        return len(self._page_of)

    def digests(self, prompt: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """The digests of ``prompt``'s pages that can be shared: each full page followed by at least
        ``lookahead`` more prompt tokens and, so that the last token is computed, one more."""
        page, ahead = self.page_size, self.lookahead
        n = max(0, (len(prompt) - max(ahead, 1)) // page)
        out, digest = [], hashlib.sha256(b"mtp-jax prefix\0" + salt).digest()
        ids = np.asarray(prompt, np.int64)
        for j in range(n):
            block = ids[j * page : (j + 1) * page + ahead]
            digest = hashlib.sha256(digest + block.tobytes()).digest()
            out.append(digest)
        return out

    def take(self, digests: Sequence[bytes], need: int, shard: int = 0) -> tuple[list[int], int]:
        """Pages for a request of ``need`` pages whose prompt has page ``digests``: (its pages in
        position order, how many of the first are cached ones, whose positions need no prefill).
        Counts the lookup in ``queries`` / ``hits``."""
        shared: list[int] = []
        for digest in digests:
            page = self._page_of.get((shard, digest))
            if page is None:
                break
            shared.append(page)
        for page in shared:
            self._idle[shard].pop(page, None)
            self._refs[page] = self._refs.get(page, 0) + 1
        fresh = need - len(shared)
        short = fresh - self.allocator.free_in(shard)
        for _ in range(max(0, short)):
            if not self._idle[shard]:
                break
            page, _ = self._idle[shard].popitem(last=False)
            del self._page_of[self._digest_of.pop(page)]
            self.allocator.release([page])
        pages = self.allocator.allocate(fresh, shard)
        for page in pages:
            self._refs[page] = 1
        self.queries += len(digests) * self.page_size
        self.hits += len(shared) * self.page_size
        return shared + pages, len(shared)

    def longest(self, digests: Sequence[bytes], shard: int = 0, pending: Iterable = ()) -> int:
        """How many of ``digests``' first pages are named on ``shard`` (its longest cached prefix),
        counting the (shard, digest) keys in ``pending`` as named (a prefill in flight names them)."""
        n = 0
        for digest in digests:
            if (shard, digest) not in self._page_of and (shard, digest) not in pending:
                break
            n += 1
        return n

    def register(self, digests: Sequence[bytes], pages: Sequence[int]) -> None:
        """Name the request's pages ``pages[j]`` by ``digests[j]`` (its prefill is dispatched: later
        prefills read what it writes). A digest named already keeps its page (this one stays the
        request's own)."""
        for digest, page in zip(digests, pages, strict=False):
            key = (self.allocator.shard_of(page), digest)
            if key not in self._page_of and page not in self._digest_of:
                self._page_of[key] = page
                self._digest_of[page] = key

    def release(self, pages: Sequence[int]) -> None:
        """A request is done with ``pages``: unnamed ones are freed, named ones stay cached."""
        free = []
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if page in self._digest_of:
                self._idle[self.allocator.shard_of(page)][page] = None
            else:
                free.append(page)
        self.allocator.release(free)


def write_rows(
    pages: jax.Array, rows: jax.Array, slots: jax.Array, layer: jax.Array | int | None = None
) -> jax.Array:
    """Scatter rows [b, t, *item] into pages [P, page, *item] at flat slots [b, t]; slots >= P·page
    are dropped. ``item`` is what one token keeps per layer: [c] for an MLA latent row, [kv_heads,
    head_dim] for K or V.

    With ``layer``, ``pages`` is a whole stack [L, P, page, *item] and only layer ``layer`` is written:
    inside a scan over layers the stack then stays in the loop carry and is updated in place,
    instead of each layer's pages being sliced out and stacked back (a copy of the whole cache
    per step).
    """
    if layer is None:
        return write_rows(pages[None], rows, slots, 0)[0]
    page_size, item = pages.shape[2], pages.shape[3:]
    slots = slots.reshape(-1)
    # an out-of-range slot (an invalid token) lands on an out-of-range page, which mode="drop" skips
    page, offset = slots // page_size, slots % page_size
    values = rows.reshape(-1, *item).astype(pages.dtype)
    if pages.dtype.itemsize == 2:
        # 16-bit caches are scattered as their bit patterns: XLA:CPU has no bfloat16 scatter and would
        # otherwise convert the whole cache stack to float32 and back on every write (a bitcast is free)
        bits = jax.lax.bitcast_convert_type(pages, jnp.uint16)
        bits = bits.at[layer, page, offset].set(jax.lax.bitcast_convert_type(values, jnp.uint16), mode="drop")
        return jax.lax.bitcast_convert_type(bits, pages.dtype)
    return pages.at[layer, page, offset].set(values, mode="drop")


def localize(
    page_table: jax.Array, slots: jax.Array, first_page: jax.Array, num_pages: int, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """Global page ids -> those of a shard holding pages [first_page, first_page + num_pages): the
    page table clamped into its range (entries outside are never read unmasked) and the write slots
    moved, those outside made out of range (not written)."""
    table = jnp.clip(page_table - first_page, 0, num_pages - 1)
    slots = slots - first_page * page_size
    return table, jnp.where((slots >= 0) & (slots < num_pages * page_size), slots, jnp.iinfo(jnp.int32).max)


def slots_for(page_table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int) -> jax.Array:
    """Flat cache slots [b, t] for tokens at positions [b, t]; invalid tokens get an out-of-range
    slot, which the cache write drops."""
    num_pages_sentinel = jnp.iinfo(jnp.int32).max
    page = jnp.take_along_axis(
        page_table, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1), axis=1
    )
    slots = page * page_size + positions % page_size
    return jnp.where(valid, slots, num_pages_sentinel)


def page_table_array(rows: list[list[int]], width: int) -> np.ndarray:
    """A [len(rows), width] int32 page table; unused entries point at page 0 (never read unmasked)."""
    table = np.zeros((len(rows), width), np.int32)
    for i, pages in enumerate(rows):
        table[i, : len(pages)] = pages
    return table


def ring_pages(window: int, page_size: int, span: int) -> int:
    """Pages of a sliding-window layer's ring per row (:func:`ring_table`): enough that a call
    writing up to ``span`` positions past the oldest query it attends for (a chunk of a prompt, a
    step's verified tokens and any scratch rows after them) never overwrites a page that query's
    window still reads: ceil((window + span) / page) + 1."""
    return -(-(window + span) // page_size) + 1


def ring_table(rows: jax.Array, ring: int, width: int) -> jax.Array:
    """The page table [b, width] through which rows in slots ``rows`` [b] read and write a
    sliding-window layer's ring: slot s owns ring pages s·ring .. s·ring + ring - 1, and a row's
    page j (positions j·page ..) is ring page j mod ``ring``. Pages further back than the ring
    alias newer ones; the window's mask never reads them (:func:`ring_pages` sizes the ring)."""
    return rows[:, None] * ring + (jnp.arange(width, dtype=rows.dtype) % ring)[None, :]
