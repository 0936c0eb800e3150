"""Token trees (mtp_jax.tree): the static shape, and the walk that accepts a path, greedily (against
a walk written here in Python) and sampled (the emitted tokens follow a Markov target's law exactly,
chi-square, with children drawn from a different draft without replacement or fixed)."""

from __future__ import annotations

import functools
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.cache import slots_for
from mtp_jax.errors import InvalidRequestError
from mtp_jax.sampling import RowSampling, accept_argmax_drafts
from mtp_jax.step import forward_paged
from mtp_jax.targets import target_for
from mtp_jax.tree import TokenTree, accept_tree, commit_path, node_mask, node_positions
from tests.conftest import EMBEDDED_MODEL, REPO
from tests.test_acceptance import assert_distribution, assert_rate, chi2_critical, has_power, pearson


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


accept = jax.jit(accept_tree, static_argnames="tree")  # as the step runs it


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
    path, emitted, n_acc = accept(
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
    _, emitted, n_acc = accept(
        jnp.asarray(logits), jnp.asarray(tokens), chain, params, jnp.zeros(b, jnp.int32)
    )
    want, want_n = jax.jit(accept_argmax_drafts)(
        jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), params, jnp.zeros(b, jnp.int32)
    )
    assert np.array_equal(n_acc, want_n)
    for i in range(b):
        assert np.array_equal(np.asarray(emitted)[i, : want_n[i] + 1], np.asarray(want)[i, : want_n[i] + 1])


@pytest.mark.parametrize("children", ["sampled", "fixed"])
def test_sampled_walk_follows_the_target_law_exactly(children):
    """A Markov target P[a] (the law after token a) and a different draft Q: trees of depth 2 with
    two children per node whose tokens the draft samples without replacement (or fixes at its top
    two). Over 80000 rows from one root token, the first emitted token follows P[root], and
    wherever a first draft was accepted the second follows P[first]: exactly (chi-square, each
    with its power at its own size; the first tokens too rare for that are pooled)."""
    tree = TokenTree.build(2, 2, 6)
    v, b, root = 5, 80_000, 2
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
    _, emitted, n_acc = accept(
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
    stat, dof, checked = 0.0, 0, 0
    for a in range(v):
        rows = (n_acc >= 1) & (emitted[:, 0] == a)
        if has_power(int(rows.sum()), target[a]):
            assert_distribution(emitted[rows, 1], target[a], f"second token after {a}, {children} children")
            checked += 1
        elif rows.sum() >= 50:
            s, d, outside = pearson(np.bincount(emitted[rows, 1], minlength=v), target[a])
            assert outside == 0
            stat, dof = stat + s, dof + d
    assert checked >= 1, checked  # the likeliest first token at least
    assert dof == 0 or stat < chi2_critical(dof), (stat, dof)


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


# --- the tree inside the step --------------------------------------------------------------------

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")


@pytest.fixture(scope="module", params=["deepseek", "llama"])
def target_model(request):
    return mtp_jax.load(EMBEDDED_MODEL if request.param == "deepseek" else LLAMA, "float32", page_size=4)


def test_tree_attention_and_the_kv_shift(target_model):
    """Every node of a tree verified at once over a paged cache has the logits of the model's own
    teacher-forced forward over the prompt and that node's path (DeepSeek: expanded attention
    there, absorbed paged attention here); after the KV shift of a path, the cache up to its end
    holds what decoding that path plainly writes."""
    model = target_model
    cfg, params, page = model.config, model.params, model.page_size
    tree = TokenTree.build(3, 2, 9)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, cfg.vocab_size, 11).tolist()
    nodes = rng.integers(1, cfg.vocab_size, tree.size).tolist()
    nodes[0] = int(rng.integers(1, cfg.vocab_size))  # the root: the committed, uncached token
    table = jnp.asarray([[5, 2, 7, 0, 3, 6, 1, 4]], jnp.int32)  # pages out of order
    target = target_for(cfg)

    def fresh():
        return target.init_cache(cfg, 8, page, jnp.float32)

    @jax.jit  # as the step runs it (op by op: ~200 one-op programs)
    def forward(params, pages, tokens, positions, tree_mask):
        valid = jnp.ones(tokens.shape, bool)
        return forward_paged(params, pages, cfg, page, tokens, positions, valid, table, tree=tree_mask)[1:]

    def write(pages, tokens, start, tree_mask=None, rope=None):
        t = len(tokens)
        positions = jnp.asarray([start + np.arange(t)], jnp.int32) if rope is None else rope
        logits, pages = forward(params, pages, jnp.asarray([tokens], jnp.int32), positions, tree_mask)
        return logits[0], pages

    _, pages = write(fresh(), prompt, 0)
    seq = jnp.asarray([len(prompt)], jnp.int32)
    got, pages = write(pages, nodes, 0, node_mask(tree.rows(1), seq), node_positions(tree.rows(1), seq))
    for n in range(tree.size):
        path = [n]
        while tree.parent[path[-1]] >= 0:
            path.append(tree.parent[path[-1]])
        tokens = prompt + [nodes[i] for i in reversed(path)]
        want = model.logits([tokens])[0, -1]
        np.testing.assert_allclose(np.asarray(got[n]), want, atol=2e-4, rtol=2e-4, err_msg=f"node {n}")
    # the KV shift of the path to the deepest node (every step moves) and of a path that ends early
    commit = jax.jit(commit_path, static_argnums=6)
    for end, accepted in ((tree.size - 1, 3), (2, 1)):
        chain = [end]
        while tree.parent[chain[-1]] > 0:
            chain.append(tree.parent[chain[-1]])
        chain = [0, *reversed(chain)][: accepted + 1]
        path = jnp.asarray([chain + [-1] * (tree.max_depth + 1 - len(chain))], jnp.int32)
        shifted = commit(pages, table, seq, path, jnp.asarray([accepted]), jnp.asarray([True]), page)
        _, plain = write(write(fresh(), prompt, 0)[1], [nodes[i] for i in chain], len(prompt))
        slots = np.asarray(slots_for(table, jnp.arange(len(prompt) + accepted + 1)[None], True, page))[0]
        for name in plain:
            a, b = np.asarray(shifted[name]), np.asarray(plain[name])
            a = a.reshape(a.shape[0], -1, *a.shape[3:])[:, slots]
            b = b.reshape(b.shape[0], -1, *b.shape[3:])[:, slots]
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"{name}, path {chain}")


def _tree_model(which: str):
    if which == "mtp":
        return mtp_jax.load(EMBEDDED_MODEL, "float32", page_size=4), "mtp"
    draft = {"eagle3": "-eagle3", "draft_model": "-draft"}[which]
    return mtp_jax.load(LLAMA, "float32", page_size=4, draft_model=LLAMA + draft), which


DYNAMIC = {"depth": 3, "topk": 2, "nodes": 6, "dynamic": True}
SHAPES = {  # two static shapes for MTP, one each for the others; a dynamic tree for MTP and EAGLE-3
    "mtp": ({"depth": 3, "topk": 2, "nodes": 7}, {"depth": 3, "topk": 3}, DYNAMIC),
    "eagle3": ({"depth": 3, "topk": 3}, DYNAMIC),
    "draft_model": ({"depth": 3, "topk": 2, "nodes": 7},),
}


@pytest.mark.parametrize("which", ["mtp", "eagle3", "draft_model"])
def test_greedy_trees_are_lossless_and_a_row_stays_itself(which):
    """Every chained draft with trees: greedy rows emit exactly plain decoding's tokens (a sampled
    row beside them changes nothing); a sampled row emits the same tokens in another slot beside
    other requests; a tree of one child per node (static or dynamic) is its chain, step for step; a
    request's num_speculative_tokens caps the depth it accepts. Dynamic trees (each row's shape its
    own, chosen every step) the same."""
    model, draft = _tree_model(which)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, model.config.vocab_size, n).tolist() for n in (5, 9, 14)]
    kw = dict(max_new_tokens=20, ignore_eos=True, draft=draft)
    plain = model.generate(prompts, max_new_tokens=20, ignore_eos=True).tokens
    chain = model.generate(prompts, num_speculative_tokens=3, **kw)
    as_tree = model.generate(prompts, speculative_tree={"depth": 3, "topk": 1}, **kw)
    assert as_tree.tokens == plain
    for stat in ("steps", "num_accepted_tokens_per_pos"):
        assert as_tree.stats[stat] == chain.stats[stat], stat
    if which == "mtp":
        as_dynamic = model.generate(prompts, speculative_tree={"depth": 3, "topk": 1, "dynamic": True}, **kw)
        for stat in ("steps", "num_accepted_tokens_per_pos"):
            assert as_dynamic.stats[stat] == chain.stats[stat], stat
    for shape in SHAPES[which]:
        tree = model.generate(prompts, speculative_tree=shape, **kw)
        assert tree.tokens == plain, shape
        assert tree.stats["acceptance_length"] > 2.0, shape  # not vacuous: drafts accepted
        mixed = model.generate(
            prompts, speculative_tree=shape, temperature=[0.0, 0.9, 0.0], seed=[0, 5, 0], **kw
        )
        assert mixed.tokens[0] == plain[0] and mixed.tokens[2] == plain[2]
        moved = [prompts[2][:3], prompts[0], prompts[1]]  # the sampled row in slot 2, others new
        elsewhere = model.generate(
            moved, speculative_tree=shape, temperature=[0.0, 0.7, 0.9], seed=[0, 9, 5], **kw
        )
        assert elsewhere.tokens[2] == mixed.tokens[1]
    for shape in {id(s): s for s in (SHAPES[which][0], SHAPES[which][-1])}.values():  # first, dynamic
        capped = model.generate(prompts, speculative_tree=shape, num_speculative_tokens=[1, 1, 1], **kw)
        assert capped.tokens == plain and capped.stats["num_accepted_tokens_per_pos"][1] == 0


MESH_CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    assert len(jax.devices()) == 8
    import mtp_jax

    deepseek, llama = sys.argv[1], sys.argv[2]
    prompts = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [10], [8, 8, 8, 8, 8, 8, 8]]
    tree = {"depth": 3, "topk": 2, "nodes": 7}
    spec = dict(max_new_tokens=10, ignore_eos=True, speculative_tree=tree)
    for target, extra, draft, meshes in [
        (deepseek, {}, "mtp", [dict(data=2, expert=4), dict(data=8)]),
        (llama, {"draft_model": llama + "-eagle3"}, "eagle3", [dict(data=4, tensor=2), dict(data=8)]),
    ]:
        one = mtp_jax.load(target, "float32", page_size=4, **extra)
        runs = {
            "argmax": dict(spec, draft=draft),
            "sampled": dict(spec, draft=draft, draft_sampling="sampled", temperature=0.9, seed=[1, 2, 3, 4]),
            "dynamic": dict(
                spec,
                draft=draft,
                speculative_tree=dict(tree, dynamic=True),
                temperature=[0, 0.8, 0, 0.8],
                seed=[1, 2, 3, 4],
            ),
        }
        want = {how: one.generate(prompts, **kw).tokens for how, kw in runs.items()}
        for axes in meshes:
            model = mtp_jax.load(target, "float32", page_size=4, mesh=mtp_jax.make_mesh(**axes), **extra)
            for how, kw in runs.items():
                got = model.generate(prompts, **kw).tokens
                assert got == want[how], (draft, axes, how, got, want[how])
    print("TREE-MESH-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(MESH_CHILD, EMBEDDED_MODEL, LLAMA)
def test_trees_on_meshes_match_one_device(child_output):
    """DeepSeek-V3 with MTP trees expert- and data-parallel, Llama with EAGLE-3 trees tensor- and
    data-parallel: the tokens of one device, greedy and sampled (the KV shift on sharded pages),
    static and dynamic trees."""
    assert "TREE-MESH-OK" in child_output


# --- dynamic trees (EAGLE-2): each row's shape chosen by the draft ---------------------------------

M, T, V_FAKE = 10_007, 64, 12


def _fake_draft(table: np.ndarray):
    """A draft whose distribution after a node is a function of the whole path that reaches it, read
    two ways that must agree: through its cache under the tree mask (the scratch rows the mask
    shows, in order) and through the recycled state it was fed (its parent's). Its depth (the
    rotary row) goes in too. A wrong mask, a wrong state gather or a wrong row changes the logits."""
    table = jnp.asarray(table)

    def advance(fed, state, cache, rows, mask):
        b, f = fed.shape
        slot = mask.positions - mask.base[:, None]  # scratch rows [b, f]
        cache = cache.at[jnp.arange(b)[:, None], slot].set(fed)
        r = cache.shape[1]
        seen = mask.nodes & (jnp.arange(r)[None, None, :] <= slot[:, :, None])
        h = jnp.broadcast_to(cache[:, :1] * 0 + ROOT_HASH, (b, f))
        for j in range(r):
            h = jnp.where(seen[:, :, j], (h * 31 + cache[:, None, j] + 1) % M, h)
        carried = (state * 31 + fed + 1) % M
        depth = rows - mask.base[:, None] + 1
        return table[(h + 7 * carried + 13 * depth) % T], h, cache

    return advance


ROOT_HASH = 5


def _reference_dynamic(table: np.ndarray, depth: int, topk: int, nodes: int) -> set:
    """EAGLE-2's tree written out: the token paths of the ``nodes`` candidates of highest cumulative
    log-probability, expanding the ``topk`` likeliest of each level."""

    def logq(x):
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    def dist(h, d):  # the fake draft's law after the path of hash h at depth d (both reads agree)
        return logq(table[(h + 7 * h + 13 * d) % T])

    root = logq(table[ROOT_HASH % T])
    cands = []  # (score, path, hash)
    front = []
    for t in np.argsort(-root, kind="stable")[:topk]:
        c = (root[t], (int(t),), (ROOT_HASH * 31 + int(t) + 1) % M)
        cands.append(c)
        front.append(c)
    for level in range(1, depth):
        kids = []
        for score, path, h in front:
            lq = dist(h, level)
            for t in np.argsort(-lq, kind="stable")[:topk]:
                kids.append((score + lq[t], path + (int(t),), (h * 31 + int(t) + 1) % M))
        cands += kids
        front = sorted(kids, key=lambda c: -c[0])[:topk]
    best = sorted(cands, key=lambda c: -c[0])[:nodes]
    return {c[1] for c in best}


@pytest.mark.parametrize(("depth", "topk", "nodes"), [(3, 2, 6), (4, 3, 12), (2, 4, 5), (5, 2, 9)])
def test_dynamic_tree_keeps_the_likeliest_candidates(depth, topk, nodes):
    """The dynamic draft tree (mtp_jax.drafts.base.dynamic_tree_drafts) against EAGLE-2's selection
    written out above, for a fake draft that reads its path through the tree mask and the recycled
    state: the same nodes (as token paths), each after its parent, on every row."""
    from mtp_jax.drafts.base import DraftContext, dynamic_tree_drafts
    from mtp_jax.tree import DynamicTree, RowTrees

    b = 6
    tree = DynamicTree(depth, topk, nodes)
    ctx = DraftContext(None, None, nodes, False, 4, tree=tree)
    rows = []
    for i in range(b):  # each row its own draft (a different table): different shapes
        table = np.random.default_rng(i).normal(size=(T, V_FAKE)).astype(np.float32) * 2
        propose = functools.partial(dynamic_tree_drafts, ctx, jnp.full((1,), 9), advance=_fake_draft(table))
        drafts, q, _ = jax.jit(propose)(
            jnp.asarray(table[ROOT_HASH % T])[None],
            jnp.full((1,), ROOT_HASH),
            jnp.full((1, tree.expanded), -1),
        )
        parent, tokens = np.asarray(drafts.parent[0]), np.asarray(drafts.tokens[0])
        assert parent[0] == -1 and all(0 <= parent[n] < n for n in range(1, nodes + 1)), parent
        paths = []
        for n in range(1, nodes + 1):
            up = paths[parent[n] - 1] if parent[n] else ()
            paths.append(up + (int(tokens[n - 1]),))
        assert set(paths) == _reference_dynamic(table, depth, topk, nodes), i
        structure = RowTrees.of(drafts.parent, tree.width, tree.max_depth)
        assert [len(p) for p in paths] == np.asarray(structure.depth[0, 1:]).tolist()
        rows.append(tuple(parent))
    assert len(set(rows)) > 1  # the rows chose different shapes


def test_row_trees_match_the_static_tree():
    """RowTrees (ancestors by pointer doubling, depths, children) of random trees against the
    static tree's own, written in Python (TokenTree.ancestors / children)."""
    from mtp_jax.tree import RowTrees

    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(2, 24))
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        tree = TokenTree.from_parents(parent)
        assert tree.depth == tuple(depth) and tree.parent == tuple(parent)
        assert all(tree.rank[m] == parent[1:m].count(parent[m]) for m in range(1, n))
        got = RowTrees.of(jnp.asarray([parent], jnp.int32), tree.width, tree.max_depth)
        assert np.array_equal(np.asarray(got.ancestors[0]), tree.ancestors())
        assert np.asarray(got.depth[0]).tolist() == depth
        assert np.array_equal(np.asarray(got.children[0]), tree.children())
    for bad in ([0, 0], [-1, 2, 0], []):
        with pytest.raises(ValueError, match="not a tree in node order"):
            TokenTree.from_parents(bad)
