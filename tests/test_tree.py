"""Token trees (mtp_jax.tree): the static shape, and the walk that accepts a path, greedily (against
a walk written here in Python) and sampled (the emitted tokens follow a Markov target's law exactly,
chi-square, with children drawn from a different draft without replacement or fixed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.errors import InvalidRequestError
from mtp_jax.sampling import RowSampling, accept_argmax_drafts
from mtp_jax.tree import TokenTree, accept_tree
from tests.test_acceptance import assert_distribution, assert_rate, chi2_critical, pearson


def test_shapes_keep_the_likeliest_nodes_and_their_ancestors():
    chain = TokenTree.build(3, 1, 3)
    assert (chain.parent, chain.depth, chain.rank) == ((-1, 0, 1, 2), (0, 1, 2, 3), (0, 0, 0, 0))
    full = TokenTree.build(2, 2, 6)
    assert full.parent == (-1, 0, 0, 1, 1, 2, 2) and full.rank == (0, 0, 1, 0, 1, 0, 1)
    # a budget of 4 of depth 3, topk 2: the first guesses' chain, then the root's second guess
    tree = TokenTree.build(3, 2, 4)
    assert tree.parent == (-1, 0, 0, 1, 3) and tree.depth == (0, 1, 1, 2, 3) and tree.rank == (0, 0, 1, 0, 0)
    assert tree.children().tolist() == [[1, 2], [3, -1], [-1, -1], [4, -1], [-1, -1]]
    mask = tree.ancestors()
    assert mask[4].tolist() == [True, True, False, True, True] and mask[2].tolist() == [
        True,
        False,
        True,
        False,
        False,
    ]
    for args, words in (
        ((0, 2, 2), "depth must be a positive"),
        ((3, 2, 2), "between 3 and 14"),
        ((2, 2, 7), "got nodes=7"),
    ):
        with pytest.raises(InvalidRequestError, match=words):
            TokenTree.build(*args)


def _reference_greedy(logits: np.ndarray, tokens: np.ndarray, tree: TokenTree) -> tuple[list[int], int]:
    kids = tree.children()
    cur, out, acc = 0, [], 0
    while True:
        top = int(np.argmax(logits[cur]))
        out.append(top)
        nxt = [c for c in kids[cur] if c >= 0 and tokens[c] == top]
        if not nxt:
            return out, acc
        cur, acc = nxt[0], acc + 1


def test_greedy_walk_follows_the_targets_argmax():
    tree = TokenTree.build(3, 3, 9)
    b, v = 64, 11
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(b, tree.size, v)).astype(np.float32)
    tokens = np.zeros((b, tree.size), np.int32)
    for i in range(b):
        for n in range(1, tree.size):  # distinct siblings; the target's argmax among them often
            parent = tree.parent[n]
            top = int(np.argmax(logits[i, parent]))
            tokens[i, n] = (
                top if rng.random() < 0.6 and tree.rank[n] == rng.integers(0, 3) else rng.integers(0, v)
            )
    params = RowSampling.build(b)
    path, emitted, n_acc = jax.jit(accept_tree, static_argnames="tree")(
        jnp.asarray(logits), jnp.asarray(tokens), tree, params, jnp.zeros(b, jnp.int32)
    )
    path, emitted, n_acc = np.asarray(path), np.asarray(emitted), np.asarray(n_acc)
    depths = set()
    for i in range(b):
        want, acc = _reference_greedy(logits[i], tokens[i], tree)
        assert n_acc[i] == acc and emitted[i, : acc + 1].tolist() == want, i
        assert all(tokens[i, path[i, j + 1]] == want[j] for j in range(acc))
        depths.add(acc)
    assert len(depths) >= 3  # several path lengths occur
    # a chain is the chained acceptance of mtp_jax.sampling
    chain = TokenTree.build(4, 1, 4)
    logits = rng.normal(size=(b, 5, v)).astype(np.float32)
    drafts = np.where(rng.random((b, 4)) < 0.7, np.argmax(logits[:, :4], -1), rng.integers(0, v, (b, 4)))
    tokens = np.concatenate([np.zeros((b, 1), np.int32), drafts], axis=1).astype(np.int32)
    _, emitted, n_acc = accept_tree(
        jnp.asarray(logits), jnp.asarray(tokens), chain, params, jnp.zeros(b, jnp.int32)
    )
    want, want_n = accept_argmax_drafts(
        jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), params, jnp.zeros(b, jnp.int32)
    )
    assert np.array_equal(n_acc, want_n)
    for i in range(b):
        assert np.array_equal(np.asarray(emitted)[i, : want_n[i] + 1], np.asarray(want)[i, : want_n[i] + 1])


@pytest.mark.parametrize("children", ["sampled", "fixed"])
def test_sampled_walk_follows_the_target_law_exactly(children):
    """A Markov target P[a] (the law after token a) and a different draft Q: trees of depth 2 with
    two children per node whose tokens the draft samples without replacement (or fixes at its top
    two). Over 20000 rows from one root token, the first emitted token follows P[root], and
    wherever a first draft was accepted the second follows P[first]: exactly (chi-square)."""
    tree = TokenTree.build(2, 2, 6)
    v, b, root = 5, 20000, 2
    rng = np.random.default_rng(7 if children == "sampled" else 8)
    target = rng.dirichlet(np.full(v, 0.9), size=v)
    target[:, -1] = 0.0  # a token the target never emits
    target /= target.sum(-1, keepdims=True)
    draft = rng.dirichlet(np.full(v, 0.9), size=v)
    kids = tree.children()
    tokens = np.zeros((b, tree.size), np.int32)
    tokens[:, 0] = root
    qs = np.zeros((b, tree.size, v), np.float32)  # the draft's law at each node (sampled children)
    key = jax.random.key(3)
    for n in range(tree.size):  # parents before children
        if kids[n, 0] < 0:
            continue
        q = jnp.asarray(draft[tokens[:, n]], jnp.float32)
        if children == "sampled":
            key, sub = jax.random.split(key)
            picks = jax.lax.top_k(jnp.log(q) + jax.random.gumbel(sub, q.shape), 2)[1].astype(jnp.int32)
            qs[:, n] = np.asarray(q)
        else:
            picks = jnp.argsort(-q, axis=-1)[:, :2].astype(jnp.int32)
        tokens[:, kids[n]] = np.asarray(picks)
    logits = np.log(np.maximum(target[tokens], 1e-30)).astype(np.float32)
    params = RowSampling.build(b, temperature=1.0, seed=list(range(b)))
    _, emitted, n_acc = jax.jit(accept_tree, static_argnames="tree")(
        jnp.asarray(logits),
        jnp.asarray(tokens),
        tree,
        params,
        jnp.full(b, 10, jnp.int32),
        jnp.asarray(qs) if children == "sampled" else None,
    )
    emitted, n_acc = np.asarray(emitted), np.asarray(n_acc)
    assert_distribution(emitted[:, 0], target[root], f"first token, {children} children")
    # the root accepts one of its two children as often as the scheme's exact probability (the
    # draft's laws matter here: accepting a sampled child as if it were fixed is exact too, but
    # accepts less often)
    assert_rate(n_acc >= 1, _root_acceptance(target[root], draft[root], children), f"{children} root")
    assert (n_acc == 2).any()
    stat, dof = 0.0, 0
    for a in range(v):
        rows = (n_acc >= 1) & (emitted[:, 0] == a)
        if rows.sum() < 50:
            continue
        s, d, outside = pearson(np.bincount(emitted[rows, 1], minlength=v), target[a])
        assert outside == 0
        stat, dof = stat + s, dof + d
    assert dof > 0 and stat < chi2_critical(dof), (stat, dof)


def _root_acceptance(p: np.ndarray, q: np.ndarray, children: str) -> float:
    """The exact probability that one of two children is accepted at a node of target law p: the
    children drawn from q without replacement ("sampled") or q's top two ("fixed")."""

    def two(c1: int, c2: int, q1: np.ndarray, q2: np.ndarray) -> float:
        a1 = min(1.0, p[c1] / q1[c1])
        rest = np.maximum(p - q1, 0.0)
        rest = rest / rest.sum() if rest.sum() > 0 else p
        return a1 + (1 - a1) * min(1.0, rest[c2] / q2[c2])

    def onehot(c: int) -> np.ndarray:
        return np.eye(len(p))[c]

    if children == "fixed":
        c1, c2 = np.argsort(-q)[:2]
        return two(c1, c2, onehot(c1), onehot(c2))
    total = 0.0
    for c1 in range(len(p)):
        q2 = q.copy()
        q2[c1] = 0.0
        q2 /= q2.sum()
        for c2 in range(len(p)):
            if c2 != c1:
                total += q[c1] * q2[c2] * two(c1, c2, q, q2)
    return total
