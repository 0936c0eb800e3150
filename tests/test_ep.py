"""Expert parallelism and data-parallel attention on 8 simulated CPU devices.

Multi-device CPU needs XLA_FLAGS before JAX starts, so each check runs in a child process (in the
background: see ``child`` in tests/conftest.py).
"""

from __future__ import annotations

import textwrap

import pytest

from mtp_jax.cache import ShardedPageAllocator
from mtp_jax.sharding import make_mesh, state_logical
from mtp_jax.targets.deepseek_v3 import ep
from tests.conftest import EMBEDDED_MODEL

PRELUDE = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
assert len(jax.devices()) == 8
"""

# Routing + routed experts alone, against the single-device MoE: on every mesh, with tokens split
# over data x expert, over data only (replicated in the group) and not at all; both paths, both
# local evaluations, both exchanges of the all-to-all path (the ragged one through its CPU
# equivalent); the capacity overflow (detected, answered by the replicated path, never dropped).
MOE_CHILD = PRELUDE + textwrap.dedent(
    """
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mtp_jax.targets.deepseek_v3 import ep
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from mtp_jax.targets.deepseek_v3.moe import route, routed_experts
    from mtp_jax.sharding import make_mesh
    from tests.conftest import TINY_CONFIG

    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ks = jax.random.split(jax.random.key(0), 5)
    gate, up = (jax.random.normal(k, (e, d, f)) * 0.1 for k in ks[:2])
    down = jax.random.normal(ks[2], (e, f, d)) * 0.1
    router = jax.random.normal(ks[3], (d, e))
    skewed = jnp.zeros(e).at[0].set(10.0)  # every token picks expert 0: one destination gets all copies
    x2, x8 = ("expert",), ("data", "expert")
    cases = {  # tokens, a2a threshold, capacity factor, skewed bias?, path, overflow, token axes
        (1, 8): [
            (64, 256, 2.0, 0, "replicated", False, x2),
            (64, 8, 2.0, 0, "a2a", False, x2),
            (64, 8, 8.0, 1, "a2a", False, x2),  # capacity x |expert|: every copy fits
        ],
        (2, 4): [
            (12, 8, 2.0, 0, "replicated", False, ("data",)),
            (64, 8, 2.0, 0, "a2a", False, x8),
            (64, 8, 1.0, 1, "a2a", True, x8),
        ],
        (8, 1): [(64, 8, 2.0, 0, "replicated", False, ("data",))],
        (3, 2): [(64, 8, 1.0, 1, "a2a", True, ())],
    }
    for shape, runs in cases.items():
        mesh = make_mesh(*shape, devices=jax.devices()[: shape[0] * shape[1]])
        g, u, dn = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (gate, up, down))
        for n, min_tok, factor, skew, path, over, axes in runs:
            bias = skewed if skew else jnp.zeros(e)
            x = jax.random.normal(ks[4], (n, d))
            w, idx = route(x, router, bias, cfg)
            want = routed_experts(x, w, idx, gate, up, down)
            want_load = np.bincount(np.asarray(idx).reshape(-1), minlength=e)
            assert ep.choose_path((n,), mesh, min_tok) == path and ep.token_axes(n, mesh) == axes, (shape, n)
            runs = [("sorted", "dense"), ("dense", "dense")] + [("sorted", "ragged")] * (path == "a2a")
            for how, exchange in runs:
                got, load, overflowed = jax.jit(
                    lambda *a: ep.moe_sharded(*a, cfg, mesh, how, min_tok, factor, exchange)
                )(x, router, bias, g, u, dn)
                assert bool(overflowed) == over, (shape, n, factor, how, exchange)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(load, want_load)
    # the CPU equivalent of ragged_all_to_all on the example of its JAX documentation
    mesh = make_mesh(1, 2, devices=jax.devices()[:2])
    args = [[1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1]]
    f = jax.shard_map(
        lambda *a: ep.ragged_all_to_all(*a, "expert"), mesh=mesh, in_specs=P("expert"), out_specs=P("expert")
    )
    out = jax.jit(f)(*(jnp.asarray(a, jnp.int32) for a in args))
    assert out.tolist() == [1, 3, 0, 0, 2, 2, 4, 0], out
    print("EP-MOE-OK")
    """
)

# The whole model: logits and greedy MTP generation sharded == one device; the expert weights
# really split; the step compiled once per mesh; prefill through the all-to-all path.
MODEL_CHILD = PRELUDE + textwrap.dedent(
    """
    import mtp_jax
    from mtp_jax import step as step_mod
    from mtp_jax.targets.deepseek_v3 import ep

    src = sys.argv[1]
    ids = [[(37 * i + 11 * j) % 2000 + 5 for j in range(16)] for i in range(2)]
    prompts = [ids[0][:9], ids[1][:13], ids[0][3:]]
    ref = mtp_jax.load(src, "float32")
    want = ref.logits(ids)
    gen = dict(max_new_tokens=10, ignore_eos=True, draft="mtp", num_speculative_tokens=3)
    want_tokens = ref.generate(prompts, **gen).tokens
    paths = []
    real = ep.routed_all_to_all
    def spy(*a):
        paths.append("a2a")
        return real(*a)
    ep.routed_all_to_all = spy
    # threshold 64: prefill (8 rows x 16 tokens) takes the all-to-all path, decode (8 x 4) the other;
    # the step checks below run on the last mesh
    cases = [((8, 1), 256, "auto"), ((1, 8), 64, "ragged"), ((2, 4), 64, "dense")]
    for shape, a2a_min, exchange in cases:
        ep.A2A_MIN_TOKENS, ep.EXCHANGE = a2a_min, exchange
        jax.clear_caches()  # the threshold is read when tracing: same mesh, new programs
        mesh = mtp_jax.make_mesh(data=shape[0], expert=shape[1])
        model = mtp_jax.load(src, "float32", mesh=mesh)
        for stack, gate in [("moe", model.params["moe"]["mlp"]["gate"]),
                            ("mtp", model.params["mtp"]["layer"]["mlp"]["gate"])]:
            per_device = {s.device: s.data.nbytes for s in gate.addressable_shards}
            assert len(per_device) == 8 and set(per_device.values()) == {gate.nbytes // shape[1]}, stack
        before = len(paths)
        np.testing.assert_allclose(model.logits(ids), want, rtol=1e-5, atol=1e-5)
        compiled = step_mod.step._cache_size()
        out = model.generate(prompts, **gen)
        assert out.tokens == want_tokens, (shape, out.tokens, want_tokens)
        assert out.stats["steps"] > 3
        assert step_mod.step._cache_size() == compiled + 1, "the sharded step recompiled"
        assert (len(paths) > before) == (shape[1] > 1), (shape, paths)
        print(shape, a2a_min, "ok", flush=True)

    # the step itself on mesh (2, 4): 8 rows and their pages split over data x expert (DP attention),
    # one compilation; no collective moves a cache page
    import re
    from mtp_jax.request import SpeculativeConfig, step_config
    from mtp_jax.sampling import RowSampling
    from mtp_jax.sharding import state_shardings
    sc = step_config(model, SpeculativeConfig("mtp", 3))
    def spec(x):
        s = tuple(x.sharding.spec)
        return s + (None,) * (x.ndim - len(s))
    for rows, axes in [(8, ("data", "expert"))]:
        state = step_mod.init_state(sc, rows, 4 * rows, 4, jnp.float32)
        state = jax.device_put(state, state_shardings(sc, state))
        table = np.arange(4 * rows, dtype=np.int32).reshape(rows, 4)
        first, state, _ = step_mod.prefill(
            model.params, state, sc, jnp.arange(rows), np.asarray(ids * (rows // 2), np.int32),
            jnp.full(rows, 16), jnp.asarray(table), RowSampling.build(rows),
        )
        compiled = step_mod.step._cache_size()
        for _ in range(3):
            emitted, n_emit, state, _ = step_mod.step(model.params, state, sc)
        assert step_mod.step._cache_size() == compiled + 1
        assert np.asarray(n_emit).min() >= 1
        assert spec(state.target_pages["moe"]) == (None, axes, None, None)
        assert spec(state.draft_state) == (axes, None, None)
        assert spec(state.seq_len) == (axes,) and spec(state.drafts) == (axes, None)
        shard = state.target_pages["moe"].addressable_shards[0].data.shape[1]
        assert shard == 4 * rows // 8, shard
        hlo = step_mod.step.lower(model.params, state, sc).compile().as_text()
        page_elems = 4 * rows * sc.page_size * state.draft_state.shape[-1] // 8  # one layer, one shard
        ops = "all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute"
        found = re.findall(r"= \\w+\\[([\\d,]*)\\]\\S* (" + ops + r")\\(", hlo)
        assert any(op == "reduce-scatter" for _, op in found), found  # the MoE hands rows back
        for dims, op in found:
            elems = int(np.prod([int(v) for v in dims.split(",") if v]))
            assert elems < page_elems, (op, dims, page_elems)
    print("EP-MODEL-OK")
    """
)


@pytest.mark.child(MOE_CHILD)
def test_expert_parallel_moe_matches_single_device(child_output):
    assert "EP-MOE-OK" in child_output


@pytest.mark.slow
@pytest.mark.child(MODEL_CHILD, EMBEDDED_MODEL)
def test_sharded_model_matches_single_device(child_output):
    assert "EP-MODEL-OK" in child_output


def test_paths_and_capacity():
    mesh = make_mesh()  # one device: no split, no all-to-all
    assert ep.token_axes(8, mesh) == () and ep.choose_path((512,), mesh, 256) == "replicated"
    assert ep.capacity(tokens=16, k=2, n_dev=4, factor=2.0) == 16
    assert ep.capacity(tokens=16, k=2, n_dev=4, factor=100.0) == 32  # never more than all copies
    assert ep.capacity(tokens=1, k=1, n_dev=8, factor=0.1) == 1
    assert ep.ragged_capacity(tokens=16, k=2, n_dev=4, factor=2.0) == 64  # received from all sources
    assert ep.ragged_capacity(tokens=16, k=2, n_dev=4, factor=100.0) == 128  # every copy of the group
    assert ep.resolve_exchange("auto") == "dense"  # this backend (CPU) has no ragged all-to-all
    assert ep.resolve_exchange("ragged") == "ragged"
    with pytest.raises(ValueError, match="exchange must be"):
        ep.resolve_exchange("nccl")


def test_state_logical_axes():
    from jax.tree_util import DictKey, GetAttrKey

    from mtp_jax.step import StepConfig
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from tests.conftest import TINY_CONFIG

    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    sc, plain = StepConfig(cfg, 16, 3, "mtp"), StepConfig(cfg, 16)
    target = (GetAttrKey("target_pages"), DictKey("moe"))
    for config in (sc, plain):  # the target's cache: split by page
        assert state_logical(target, (7, 64, 16, 8), config) == (None, "pages", None, None)
    assert state_logical((GetAttrKey("draft_state"),), (64, 16, 8), sc) == ("pages", None, None)
    assert state_logical((GetAttrKey("drafts"),), (4, 3), sc) == ("batch", None)
    assert state_logical((GetAttrKey("seq_len"),), (4,), plain) == ("batch",)


def test_sharded_page_allocator_keeps_pages_on_their_shard():
    alloc = ShardedPageAllocator(16, shards=4)
    a, b = alloc.allocate(3, shard=1), alloc.allocate(4, shard=3)
    assert all(4 <= p < 8 for p in a) and all(12 <= p < 16 for p in b)
    assert alloc.free == 9
    with pytest.raises(RuntimeError, match="out of KV pages"):
        alloc.allocate(2, shard=1)
    alloc.release(a + b)
    assert alloc.free == 16 and alloc.allocate(4, shard=1) == [4, 5, 6, 7]
    assert ShardedPageAllocator(6).allocate(6) == list(range(6))
    with pytest.raises(ValueError, match="equal shards"):
        ShardedPageAllocator(6, shards=4)
