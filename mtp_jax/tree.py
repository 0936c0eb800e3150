"""Token trees (issue 35, in progress): a static tree of drafts and the walk that accepts a path.

A chain of K drafts stops at the first wrong guess; a tree proposes several candidates per depth
and the target verifies every node at once, each node attending to the committed context and its
own ancestors. :class:`TokenTree` is the static shape (compiled once per engine), built from a
depth, a branching (each node's ``topk`` most likely children) and a node budget, the nodes most
likely to be accepted first. :func:`accept_tree` walks it with the target's distributions at every
node: greedily (the child that is the target's argmax) or by multi-draft speculative sampling
among each node's children (:func:`mtp_jax.sampling.accept_siblings`), so that the emitted tokens
follow the target's law exactly. Not yet wired into the step: the tree attention mask, the drafts'
expansion and the KV shift of the accepted path come next.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.errors import InvalidRequestError
from mtp_jax.sampling import ACCEPT, RowSampling, accept_siblings, processed_logprobs, repeat_rows, row_keys


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """A static token tree. Node 0 is the root (the committed token the step verifies first),
    nodes 1..N the drafts, each after its parent. ``parent[n]`` (-1 for the root), ``depth[n]``
    (the root's 0), ``rank[n]``: which of its parent's candidates it is (0: the parent's most likely
    continuation under the draft). A chain of K drafts is ``TokenTree.build(K, 1, K)``."""

    parent: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]

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

    @property
    def size(self) -> int:
        """Nodes, the root included."""
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

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


def accept_tree(
    target_logits: jax.Array,
    tokens: jax.Array,
    tree: TokenTree,
    params: RowSampling,
    first: jax.Array,
    draft_laws: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walk ``tree`` from the root and accept the longest path the target allows.

    ``target_logits`` [B, N, V]: the target's logits at every node (N = tree.size: its distribution
    for the token after that node); ``tokens`` [B, N]: each node's token (the root's is the committed
    one); ``first`` [B]: the position of the first token emitted (the root's position + 1).
    Greedy rows (temperature 0) follow the child that is the target's argmax. Sampled rows accept
    among each node's children by multi-draft speculative sampling, with ``draft_laws`` [B, N, c, V]
    the law each child was drawn from given its earlier siblings (for node n, its children in rank
    order; :func:`mtp_jax.sampling.without_replacement` of the draft's distribution at n for
    children sampled without replacement, one-hots for fixed top-k children); the emitted tokens
    then follow the target's (processed) law exactly. With ``draft_laws`` None every child is taken
    as fixed (one-hot laws). A path that reaches a leaf emits one more token drawn from the target
    at the leaf.

    Returns (path [B, D+1]: the accepted nodes from the root, -1 after the last; emitted
    [B, D+1]: the tokens emitted, a path's nodes' tokens after the root then the target's own at
    its end; n_accepted [B]: drafts accepted, so row b emits ``emitted[b, :n_accepted[b] + 1]``),
    D = tree.max_depth."""
    b, n, v = target_logits.shape
    kids = jnp.asarray(tree.children())  # [N, c]
    logp = processed_logprobs(target_logits.reshape(b * n, v), repeat_rows(params, n)).reshape(b, n, v)
    p = jnp.exp(logp)
    greedy_pick = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    stochastic = params.temperature > 0
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path, emitted = [cur], []
    n_acc = jnp.zeros((b,), jnp.int32)
    for d in range(tree.max_depth + 1):
        child_ids = kids[cur]  # [B, c]
        given = (child_ids >= 0) & alive[:, None]
        safe = jnp.maximum(child_ids, 0)
        candidates = jnp.take_along_axis(tokens, safe, axis=1)  # [B, c]
        if draft_laws is None:
            laws = jax.nn.one_hot(candidates, v, dtype=jnp.float32)
        else:
            laws = draft_laws[rows, cur]  # [B, c, V]
        keys = row_keys(params.seed, first + d, ACCEPT)
        chosen, token = accept_siblings(p[rows, cur], candidates, laws, keys, given)
        # greedy rows: the child whose token is the target's argmax at this node, if any
        target_top = greedy_pick[rows, cur]
        match = given & (candidates == target_top[:, None])
        g_chosen = jnp.where(match.any(-1), jnp.argmax(match, axis=-1), -1).astype(jnp.int32)
        chosen = jnp.where(stochastic, chosen, g_chosen)
        token = jnp.where(stochastic, token, target_top)
        moved = alive & (chosen >= 0)
        nxt = jnp.take_along_axis(safe, jnp.maximum(chosen, 0)[:, None], axis=1)[:, 0]
        emitted.append(jnp.where(alive, token, 0))
        n_acc = n_acc + moved.astype(jnp.int32)
        cur = jnp.where(moved, nxt, cur)
        alive = moved
        if d < tree.max_depth:
            path.append(jnp.where(moved, nxt, -1))
    return jnp.stack(path, axis=1), jnp.stack(emitted, axis=1).astype(jnp.int32), n_acc
