"""Expert parallelism and data-parallel attention on 8 simulated CPU devices.

Multi-device CPU needs XLA_FLAGS before JAX starts, so each check runs in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mtp_jax import ep
from mtp_jax.cache import ShardedPageAllocator
from mtp_jax.sharding import make_mesh, state_logical
from tests.conftest import EMBEDDED_MODEL, REPO

PRELUDE = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
assert len(jax.devices()) == 8
"""

# The routed experts alone: both paths of every mesh against the single-device MoE, in both local
# evaluations, and the capacity overflow (detected, answered by the replicated path, never dropped).
MOE_CHILD = PRELUDE + textwrap.dedent(
    """
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mtp_jax import ep
    from mtp_jax.config import DeepseekV3Config
    from mtp_jax.moe import route, routed_experts
    from mtp_jax.sharding import make_mesh
    from tests.conftest import TINY_CONFIG

    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ks = jax.random.split(jax.random.key(0), 5)
    gate, up = (jax.random.normal(k, (e, d, f)) * 0.1 for k in ks[:2])
    down = jax.random.normal(ks[2], (e, f, d)) * 0.1
    router = jax.random.normal(ks[3], (d, e))
    skewed = jnp.zeros(e).at[0].set(10.0)  # every token picks expert 0: one destination gets all copies
    for shape in [(1, 8), (2, 4), (8, 1)]:
        mesh = make_mesh(*shape)
        g, u, dn = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (gate, up, down))
        for n, min_tok, factor, bias, path, over in [
            (12, 256, 2.0, jnp.zeros(e), "replicated", False),
            (64, 8, 2.0, jnp.zeros(e), "a2a", False),
            (64, 8, 1.0, skewed, "a2a", True),
            (64, 8, float(shape[1]), skewed, "a2a", False),
        ]:
            if shape[1] == 1:
                continue
            x = jax.random.normal(ks[4], (n, d))
            w, idx = route(x, router, bias, cfg)
            want = routed_experts(x, w, idx, gate, up, down)
            assert ep.choose_path(n, mesh, min_tok) == path
            for how in ("sorted", "dense"):
                got, overflowed = jax.jit(
                    lambda *a: ep.routed_experts_ep(*a, cfg, mesh, how, min_tok, factor)
                )(x, w, idx, g, u, dn)
                assert bool(overflowed) == over, (shape, n, factor, how)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print("EP-MOE-OK")
    """
)

# The whole model: logits and greedy MTP generation sharded == one device; the expert weights
# really split; the step compiled once per mesh; prefill through the all-to-all path.
MODEL_CHILD = PRELUDE + textwrap.dedent(
    """
    import mtp_jax
    from mtp_jax import ep, step as step_mod

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
    for shape, a2a_min in [((1, 8), 256), ((2, 4), 256), ((8, 1), 256), ((2, 4), 16)]:
        ep.A2A_MIN_TOKENS = a2a_min
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
        assert (len(paths) > before) == (a2a_min == 16), (shape, paths)
        print(shape, a2a_min, "ok", flush=True)

    # the step itself on mesh (2, 4): rows and pages stay split over data, one compilation
    from mtp_jax.sampling import SamplingParams
    from mtp_jax.sharding import state_shardings
    sc = model._step_config("mtp", 3, "argmax")
    state = step_mod.init_state(sc, 4, 16, 4, jnp.float32)
    state = jax.device_put(state, state_shardings(mesh, state))
    table = np.arange(16, dtype=np.int32).reshape(4, 4)
    first, state = step_mod.prefill(
        model.params, state, sc, jnp.arange(4), np.asarray(ids * 2, np.int32), jnp.full(4, 16),
        jnp.asarray(table), SamplingParams.build(4),
    )
    compiled = step_mod.step._cache_size()
    for _ in range(3):
        emitted, n_emit, state = step_mod.step(model.params, state, sc)
    assert step_mod.step._cache_size() == compiled + 1
    def spec(x):
        s = tuple(x.sharding.spec)
        return s + (None,) * (x.ndim - len(s))
    assert spec(state.target_pages["moe"]) == (None, "data", None, None)
    assert spec(state.draft_pages) == ("data", None, None)
    assert spec(state.seq_len) == ("data",) and spec(state.drafts) == ("data", None)
    assert state.target_pages["moe"].addressable_shards[0].data.shape[1] == 8
    print("EP-MODEL-OK")
    """
)


def _run(code: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_expert_parallel_moe_matches_single_device():
    assert "EP-MOE-OK" in _run(MOE_CHILD)


@pytest.mark.slow
def test_sharded_model_matches_single_device():
    assert "EP-MODEL-OK" in _run(MODEL_CHILD, EMBEDDED_MODEL)


def test_paths_and_capacity():
    mesh = make_mesh()  # one device: expert axis 1, no expert parallelism
    assert not ep.expert_parallel(mesh) and not ep.expert_parallel(None)
    assert ep.capacity(tokens=16, k=2, n_dev=4, factor=2.0) == 16
    assert ep.capacity(tokens=16, k=2, n_dev=4, factor=100.0) == 32  # never more than all copies
    assert ep.capacity(tokens=1, k=1, n_dev=8, factor=0.1) == 1


def test_state_logical_axes():
    from jax.tree_util import DictKey, GetAttrKey

    assert state_logical((GetAttrKey("target_pages"), DictKey("moe")), (7, 64, 16, 8)) == (
        None,
        "pages",
        None,
        None,
    )
    assert state_logical((GetAttrKey("draft_pages"),), (64, 16, 8)) == ("pages", None, None)
    assert state_logical((GetAttrKey("draft_pages"),), (0,)) == (None,)
    assert state_logical((GetAttrKey("drafts"),), (4, 3)) == ("batch", None)


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
