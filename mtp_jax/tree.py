"""Token trees: a static tree of drafts, the walk that accepts a path, and the KV shift after it.

A chain of K drafts stops at the first wrong guess; a tree proposes several candidates per depth
and the target verifies every node at once, each node attending to the committed context and its
own ancestors. :class:`TokenTree` is the static shape (compiled once per engine), built from a
depth, a branching (each node's ``topk`` most likely children) and a node budget, the nodes most
likely to be accepted first. :func:`accept_tree` walks it with the target's distributions at every
node: greedily (the child that is the target's argmax) or by multi-draft speculative sampling
among each node's children (:func:`mtp_jax.sampling.accept_siblings`), so that the emitted tokens
follow the target's law exactly. :func:`node_mask` and :func:`node_positions` place the nodes for
the target's tree attention; :func:`commit_path` moves the accepted path's cache entries to
consecutive positions. The step's use of them: :func:`mtp_jax.step.step` with
``StepConfig.tree``; docs/architecture.md, "Token trees".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache import slots_for
from mtp_jax.errors import InvalidRequestError
from mtp_jax.sampling import (
    ACCEPT,
    RowSampling,
    accept_siblings,
    processed_logprobs,
    repeat_rows,
    row_keys,
    traced_greedy_only,
    without_replacement,
)
from mtp_jax.targets.base import TreeMask


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """A static token tree. Node 0 is the root (the committed token the step verifies first),
    nodes 1..N the drafts, each after its parent. ``parent[n]`` (-1 for the root), ``depth[n]``
    (the root's 0), ``rank[n]``: which of its parent's candidates it is (0: the parent's most likely
    continuation under the draft). A chain of K drafts is ``TokenTree.build(K, 1, K)``."""

    parent: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]
    dynamic = False  # the shape is the same for every row (:class:`DynamicTree`: each row's own)

    @classmethod
    def build(cls, depth: int, topk: int, nodes: int) -> TokenTree:
        """Of the full tree where every node up to ``depth`` has ``topk`` children, the ``nodes``
        drafts most likely to be accepted: ordered by the sum of the ranks along their path (a
        draft's i-th guess is accepted less often than its first), then by depth. Every node's
        ancestors come before it, so any budget gives a tree. SGLang's ``speculative_eagle_topk`` /
        ``speculative_num_steps`` / ``speculative_num_draft_tokens`` (minus the root) map onto
        ``topk`` / ``depth`` / ``nodes``."""
        for name, value in (("depth", depth), ("topk", topk), ("nodes", nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"a token tree's {name} must be a positive integer, got {value!r}")
        full = sum(topk**d for d in range(1, depth + 1))
        if not depth <= nodes <= full:
            raise InvalidRequestError(
                f"a token tree of depth {depth} and topk {topk} has between {depth} and {full} draft nodes "
                f"(its first guesses' chain up to all of them), got nodes={nodes}"
            )
        paths = [p for d in range(1, depth + 1) for p in itertools.product(range(topk), repeat=d)]
        kept = sorted(paths, key=lambda p: (sum(p), len(p), p))[:nodes]
        kept.sort(key=lambda p: (len(p), p))  # breadth first: parents before children
        index = {(): 0} | {p: i + 1 for i, p in enumerate(kept)}
        return cls(
            parent=(-1, *(index[p[:-1]] for p in kept)),
            depth=(0, *(len(p) for p in kept)),
            rank=(0, *(p[-1] for p in kept)),
        )

    @classmethod
    def from_parents(cls, parent: Sequence[int]) -> TokenTree:
        """The tree of one row's ``parent`` list (node 0 the root, every node after its parent; a
        dynamic tree's row), siblings ranked in node order."""
        parent = tuple(int(p) for p in parent)
        if not parent or parent[0] >= 0 or any(not 0 <= p < n for n, p in enumerate(parent) if n):
            raise ValueError(
                f"not a tree in node order (the root first, then each node after its parent): {parent}"
            )
        depth, rank, seen = [0], [0], [0] * len(parent)
        for p in parent[1:]:
            depth.append(depth[p] + 1)
            rank.append(seen[p])
            seen[p] += 1
        return cls(parent=(-1, *parent[1:]), depth=tuple(depth), rank=tuple(rank))

    @property
    def size(self) -> int:
        """Nodes, the root included."""
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def width(self) -> int:
        """The most children a node has."""
        return int(self.children().shape[1])

    def children(self) -> np.ndarray:
        """[size, widest] int32: each node's children by rank, -1 where it has fewer."""
        kids: list[list[int]] = [[] for _ in self.parent]
        for n, p in enumerate(self.parent):
            if p >= 0:
                kids[p].append(n)
        width = max(1, max(len(k) for k in kids))
        out = np.full((self.size, width), -1, np.int32)
        for n, k in enumerate(kids):
            ordered = sorted(k, key=lambda c: self.rank[c])
            out[n, : len(ordered)] = ordered
        return out

    def paths(self) -> list[tuple[int, ...]]:
        """Each leaf's path from the root (node ids, the root first), leaves in node order."""
        kids = self.children()
        out = []
        for leaf in range(self.size):
            if kids[leaf, 0] >= 0:
                continue
            path = [leaf]
            while self.parent[path[-1]] >= 0:
                path.append(self.parent[path[-1]])
            out.append(tuple(reversed(path)))
        return out

    def rows(self, b: int) -> RowTrees:
        """The tree as device data, the same for each of ``b`` rows (:class:`RowTrees`)."""
        parent = jnp.broadcast_to(jnp.asarray(self.parent, jnp.int32), (b, self.size))
        return RowTrees.of(parent, self.width, self.max_depth)

    def ancestors(self) -> np.ndarray:
        """[size, size] bool: node i may attend to node j (j is i or one of its ancestors): the tree
        attention mask over the nodes (each also attends to the whole committed context)."""
        mask = np.eye(self.size, dtype=bool)
        for n in range(self.size):
            p = self.parent[n]
            while p >= 0:
                mask[n, p] = True
                p = self.parent[p]
        return mask


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A token tree whose shape each row chooses at run time (EAGLE-2's dynamic draft tree):
    the draft expands, level by level, the ``topk`` nodes of highest cumulative draft
    log-probability (each proposing its ``topk`` likeliest children), ``depth`` levels deep, and
    the ``nodes`` candidates of highest cumulative log-probability of all it proposed are verified
    (a node's ancestors are always among them: a path's log-probability only falls). The static
    part, a node budget and a depth, is the compiled shape; each row's parents are data
    (:class:`RowTrees`). The candidates are the draft's likeliest tokens (fixed, as for n-gram), so
    sampled rows are accepted with one-hot laws (:func:`accept_tree` with ``draft_q`` None)."""

    depth: int
    topk: int
    nodes: int
    dynamic = True

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(
                    f"a dynamic token tree's {name} must be a positive integer, got {value!r}"
                )
        most = self.candidates(self.depth, self.topk)
        if not self.depth <= self.nodes <= most:
            raise InvalidRequestError(
                f"a dynamic token tree of depth {self.depth} and topk {self.topk} verifies between "
                f"{self.depth} and {most} draft nodes (the candidates it proposes), got nodes={self.nodes}"
            )

    @property
    def size(self) -> int:
        """Nodes, the root included."""
        return self.nodes + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    @staticmethod
    def candidates(depth: int, topk: int) -> int:
        """The candidates a dynamic tree of ``depth`` and ``topk`` proposes (the most it verifies)."""
        return topk + (depth - 1) * topk**2

    @property
    def width(self) -> int:
        """The most children a node can have."""
        return self.topk

    @property
    def expanded(self) -> int:
        """The candidates the draft runs through itself (its scratch rows): ``topk`` per level
        below the root's children's level."""
        return (self.depth - 1) * self.topk


class RowTrees(NamedTuple):
    """Each row's token tree as device data: ``parent`` [b, N] (node 0 the root, -1; every node
    after its parent), ``ancestors`` [b, N, N] (node i may attend to node j), ``depth`` [b, N],
    ``children`` [b, N, c] (each node's children in node order, -1 where it has fewer)."""

    parent: jax.Array
    ancestors: jax.Array
    depth: jax.Array
    children: jax.Array

    @classmethod
    def of(cls, parent: jax.Array, width: int, max_depth: int) -> RowTrees:
        """The structure of trees of at most ``width`` children per node, ``max_depth`` deep, from
        their ``parent`` [b, N]: ancestors by pointer doubling (log2 of the depth gathers)."""
        b, n = parent.shape
        own = jnp.arange(n, dtype=jnp.int32)
        jump = jnp.where(parent >= 0, parent, own[None, :])  # the root is its own parent
        seen = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
        for _ in range(max(1, max_depth).bit_length()):  # 2^steps - 1 >= max_depth levels up
            seen = seen | jnp.take_along_axis(seen, jnp.broadcast_to(jump[:, :, None], (b, n, n)), axis=1)
            jump = jnp.take_along_axis(jump, jump, axis=1)
        depth = jnp.sum(seen, axis=-1, dtype=jnp.int32) - 1
        child = parent[:, None, :] == own[None, :, None]  # [b, node, candidate child]
        order = jnp.sort(jnp.where(child, own[None, None, :], n), axis=-1)[..., :width]
        return cls(parent, seen, depth, jnp.where(order < n, order, -1).astype(jnp.int32))


def tree_setting(text: str) -> dict:
    """The ``speculative_tree`` setting written ``DEPTH,TOPK[,NODES][,dynamic]`` (the command
    lines' form); ValueError naming the expected form otherwise."""
    parts = [p.strip() for p in text.split(",")]
    dynamic = parts[-1] == "dynamic"
    if dynamic:
        parts.pop()
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise ValueError(
            f"expected DEPTH,TOPK or DEPTH,TOPK,NODES (integers), then optionally ',dynamic', got {text!r}"
        )
    spec = dict(zip(("depth", "topk", "nodes"), (int(p) for p in parts), strict=False))
    return spec | {"dynamic": True} if dynamic else spec


def accept_tree(
    target_logits: jax.Array,
    tokens: jax.Array,
    tree: TokenTree | DynamicTree,
    params: RowSampling,
    first: jax.Array,
    draft_q: jax.Array | None = None,
    cap: jax.Array | None = None,
    rows: RowTrees | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walk ``tree`` from the root and accept the longest path the target allows.

    ``target_logits`` [B, N, V]: the target's logits at every node (N = tree.size: its distribution
    for the token after that node); ``tokens`` [B, N]: each node's token (the root's is the committed
    one); ``first`` [B]: the position of the first token emitted (the root's position + 1).
    Greedy rows (temperature 0) follow the child that is the target's argmax. Sampled rows accept
    among each node's children by multi-draft speculative sampling: with ``draft_q`` [B, N, V] each
    node's children were drawn one after another without replacement from its distribution there
    (their laws: :func:`mtp_jax.sampling.without_replacement`); with ``draft_q`` None they are taken
    as fixed (the draft's top ones: one-hot laws). The emitted tokens then follow the target's
    (processed) law exactly. A path that reaches a leaf emits one more token drawn from the target
    at the leaf. ``cap`` [B]: accept at most that many drafts (nodes deeper than it are skipped).

    Returns (path [B, D+1]: the accepted nodes from the root, -1 after the last; emitted
    [B, D+1]: the tokens emitted, a path's nodes' tokens after the root then the target's own at
    its end; n_accepted [B]: drafts accepted, so row b emits ``emitted[b, :n_accepted[b] + 1]``),
    D = tree.max_depth. ``rows``: each row's own tree of ``tree``'s size (:class:`RowTrees`;
    default: ``tree``'s static shape in every row)."""
    b, n, v = target_logits.shape
    kids = (tree.rows(b) if rows is None else rows).children  # [B, N, c]

    def processed() -> jax.Array:
        flat = processed_logprobs(target_logits.reshape(b * n, v), repeat_rows(params, n))
        return jnp.exp(flat).reshape(b, n, v)

    all_greedy = traced_greedy_only()  # a greedy program: no sampled acceptance traced at all
    if not all_greedy:  # an all-greedy batch skips the vocabulary sorts of the processed distributions
        nothing = lambda: jnp.zeros((b, n, v), jnp.float32)  # noqa: E731
        p = jax.lax.cond(jnp.any(params.temperature > 0), processed, nothing)
    greedy_pick = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    stochastic = params.temperature > 0
    rows_ = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path, emitted = [cur], []
    n_acc = jnp.zeros((b,), jnp.int32)
    for d in range(tree.max_depth + 1):
        child_ids = kids[rows_, cur]  # [B, c]
        given = (child_ids >= 0) & alive[:, None]
        if cap is not None:
            given &= (cap > d)[:, None]
        safe = jnp.maximum(child_ids, 0)
        candidates = jnp.take_along_axis(tokens, safe, axis=1)  # [B, c]
        # greedy rows: the child whose token is the target's argmax at this node, if any
        target_top = greedy_pick[rows_, cur]
        match = given & (candidates == target_top[:, None])
        chosen = jnp.where(match.any(-1), jnp.argmax(match, axis=-1), -1).astype(jnp.int32)
        token = target_top
        if not all_greedy:
            if draft_q is None:
                laws = jax.nn.one_hot(candidates, v, dtype=jnp.float32)
            else:
                laws = without_replacement(draft_q[rows_, cur], candidates)  # [B, c, V]
            keys = row_keys(params.seed, first + d, ACCEPT)
            s_chosen, s_token = accept_siblings(p[rows_, cur], candidates, laws, keys, given)
            chosen = jnp.where(stochastic, s_chosen, chosen)
            token = jnp.where(stochastic, s_token, token)
        moved = alive & (chosen >= 0)
        nxt = jnp.take_along_axis(safe, jnp.maximum(chosen, 0)[:, None], axis=1)[:, 0]
        emitted.append(jnp.where(alive, token, 0))
        n_acc = n_acc + moved.astype(jnp.int32)
        cur = jnp.where(moved, nxt, cur)
        alive = moved
        if d < tree.max_depth:
            path.append(jnp.where(moved, nxt, -1))
    return jnp.stack(path, axis=1), jnp.stack(emitted, axis=1).astype(jnp.int32), n_acc


def node_mask(trees: RowTrees, base: jax.Array) -> TreeMask:
    """The tree attention of all of each row's tree's nodes, node n at cache position ``base`` [b] + n."""
    n = trees.parent.shape[1]
    return TreeMask(
        positions=base[:, None] + jnp.arange(n, dtype=base.dtype)[None, :],
        base=base,
        nodes=trees.ancestors,
    )


def node_positions(trees: RowTrees, base: jax.Array) -> jax.Array:
    """The rotary positions [b, N] of each row's tree's nodes after the root at ``base`` [b]: its depth on."""
    return base[:, None] + trees.depth.astype(base.dtype)


def along_path(x: jax.Array, path: jax.Array, axis: int = 1) -> jax.Array:
    """x's entries at the nodes of ``path`` [b, D+1] (-1: past the path's end, read as the root)
    along ``axis`` (the node axis; the batch axis comes right before it)."""
    index = jnp.maximum(path, 0).reshape(path.shape + (1,) * (x.ndim - axis - 1))
    index = jnp.broadcast_to(index, x.shape[:axis] + path.shape[1:] + x.shape[axis + 1 :])
    return jnp.take_along_axis(x, index, axis=axis)


def commit_path(
    pages: dict,
    page_table: jax.Array,
    base: jax.Array,
    path: jax.Array,
    n_accepted: jax.Array,
    active: jax.Array,
    page_size: int,
) -> dict:
    """The KV shift: in a cache of leaves [L, P, page, ...] (every layer), the entries of the
    accepted path's nodes (``path`` [b, D+1], written at cache positions base [b] + node) moved to
    consecutive positions base + 1 .. base + n_accepted (the root already sits at base), as if the
    path had been decoded plainly. Entries past them are stale: later steps mask and overwrite them."""
    d = path.shape[1] - 1
    steps = jnp.arange(1, d + 1, dtype=base.dtype)[None, :]
    moving = active[:, None] & (steps <= n_accepted[:, None]) & (path[:, 1:] != steps)
    src = slots_for(page_table, base[:, None] + jnp.maximum(path[:, 1:], 0), moving, page_size).reshape(-1)
    dst = slots_for(page_table, base[:, None] + steps, moving, page_size).reshape(-1)

    def shift(leaf: jax.Array) -> jax.Array:
        layers, num_pages = leaf.shape[:2]
        bits = leaf.dtype.itemsize == 2  # as bit patterns: XLA:CPU has no 16-bit gather or scatter
        flat = jax.lax.bitcast_convert_type(leaf, jnp.uint16) if bits else leaf
        flat = flat.reshape(layers, num_pages * page_size, *leaf.shape[3:])
        rows = flat[:, jnp.minimum(src, num_pages * page_size - 1)]
        flat = flat.at[:, dst].set(rows, mode="drop")
        flat = flat.reshape(leaf.shape)
        return jax.lax.bitcast_convert_type(flat, leaf.dtype) if bits else flat

    return jax.tree.map(shift, pages)
