"""Paged KV caches, target-independent parts: page allocation and slot arithmetic.

Device side a cache is whatever its model keeps per token (:attr:`mtp_jax.targets.base.Target.
init_cache`: DeepSeek-V3's latent rows, Llama's K/V heads), in pages of ``page_size`` positions, plus
a page table [B, pages_per_row] naming each row's pages in position order. Host side,
:class:`PageAllocator` hands pages out and takes them back.
"""

from __future__ import annotations

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
        self.per_shard = num_pages // shards
        self._parts = [PageAllocator(self.per_shard) for _ in range(shards)]

    @property
    def free(self) -> int:
        return sum(part.free for part in self._parts)

    def allocate(self, n: int, shard: int = 0) -> list[int]:
        base = shard * self.per_shard
        return [base + p for p in self._parts[shard].allocate(n)]

    def release(self, pages: list[int]) -> None:
        for shard, part in enumerate(self._parts):
            base = shard * self.per_shard
            mine = [p - base for p in pages if base <= p < base + self.per_shard]
            if mine:
                part.release(mine)


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
