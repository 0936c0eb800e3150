"""Llama-family (Llama 3, Qwen2, Qwen3, and Gemma 3 on the same layout) tensor parallelism (heads
and MLP columns over ``tensor``, rows and pages over ``data``) on 8 simulated CPU devices, in a
background child process (see ``child`` in tests/conftest.py)."""

from __future__ import annotations

import os
import textwrap

import pytest

from mtp_jax.gqa import check_tensor_split
from mtp_jax.sharding import param_logical
from tests.conftest import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "parity_llama")

# Against one device: logits, greedy and sampled generation on every (data, tensor) split of 8
# devices, for KV heads split over `tensor` (4 KV heads, tensor 2 / 4) and replicated (tensor 8, and
# the 1-KV-head fixture); the weights really split; one compilation of the step per mesh; the
# cache's KV heads split exactly when they divide the axis; no collective moves a cache page; a
# converted (orbax) checkpoint restores straight into the tensor-parallel shardings.
TP_CHILD = textwrap.dedent(
    """
    import os, re, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    assert len(jax.devices()) == 8
    import mtp_jax
    from mtp_jax.request import SpeculativeConfig, step_config
    from mtp_jax import step as step_mod
    from mtp_jax.sampling import RowSampling

    root = sys.argv[1]
    gen = dict(max_new_tokens=12, ignore_eos=True)
    sampled = dict(gen, temperature=0.8, top_p=0.9, seed=[3, 4, 5])
    for name, meshes in [
        ("mha_fp16", [(1, 8), (2, 4), (4, 2), (8, 1)]),  # 8 KV heads: split over tensor 2..8
        ("gqa81_tied_head_dim", [(2, 4), (1, 8)]),  # 1 KV head: replicated, every device reads it
        ("llama3_gqa42", [(4, 2), (1, 4)]),  # 2 KV heads: split over 2, replicated over 4
        ("qwen2_bias_tied", [(2, 4)]),  # q/k/v biases split with their heads
        ("qwen3_qk_norm", [(4, 2)]),  # per-head q/k norms on split heads
        # Gemma 3: Llama's layout under its own forward; sliding windows on split heads, one KV
        # head replicated, then two split with a vocabulary-parallel soft-capped head
        ("../parity_gemma3/pattern6_tied", [(2, 2)]),
        ("../parity_gemma3/mixed_softcap_linear_untied", [(4, 2)]),
    ]:
        src = os.path.join(root, name)
        ref = mtp_jax.load(src, "float32")
        data = np.load(os.path.join(src, "reference.npz"))
        ids = data["input_ids"]
        prompts = [list(map(int, ids[0][:7])), list(map(int, ids[1][:11])), list(map(int, ids[0][2:9]))]
        want = ref.logits(ids)
        want_greedy = ref.generate(prompts, **gen).tokens
        want_sampled = ref.generate(prompts, **sampled).tokens
        cfg = ref.config
        for data_n, tensor_n in meshes:
            if data_n * tensor_n < 8:
                devices = jax.devices()[: data_n * tensor_n]
                mesh = mtp_jax.make_mesh(data=data_n, tensor=tensor_n, devices=devices)
            else:
                mesh = mtp_jax.make_mesh(data=data_n, tensor=tensor_n)
            model = mtp_jax.load(src, "float32", mesh=mesh)
            q = model.params["layers"]["attn"]["q"]
            shard = q.addressable_shards[0].data.shape
            assert shard[2] == cfg.num_attention_heads // tensor_n, (name, shard)
            down = model.params["layers"]["mlp"]["down"]
            assert down.addressable_shards[0].data.shape[1] == cfg.intermediate_size // tensor_n
            np.testing.assert_allclose(model.logits(ids), want, rtol=2e-5, atol=2e-5)
            compiled = step_mod.step._cache_size()
            assert model.generate(prompts, **gen).tokens == want_greedy, (name, data_n, tensor_n)
            assert step_mod.step._cache_size() == compiled + 1, "the sharded step recompiled"
            assert model.generate(prompts, **sampled).tokens == want_sampled, (name, data_n, tensor_n)

            # the state: rows and pages over data, KV heads over tensor when they divide it
            sc = step_config(model, SpeculativeConfig())
            rows = 2 * data_n
            state = step_mod.init_state(sc, rows, 4 * rows, 4, jnp.float32)
            state = jax.device_put(state, mtp_jax.sharding.state_shardings(sc, state))
            spec = tuple(state.target_pages["k"].sharding.spec) + (None,) * 5
            kv_split = cfg.num_key_value_heads % tensor_n == 0 and tensor_n > 1
            assert spec[1] == ("data" if data_n > 1 else None), spec
            assert spec[3] == ("tensor" if kv_split else None), (name, tensor_n, spec)
            table = np.arange(4 * rows, dtype=np.int32).reshape(rows, 4)
            toks = np.asarray([prompts[0][:6]] * rows, np.int32)
            _, state, _ = step_mod.prefill(
                model.params, state, sc, jnp.arange(rows), toks, jnp.full(rows, 6), jnp.asarray(table),
                RowSampling.build(rows),
            )
            hlo = step_mod.step.lower(model.params, state, sc).compile().as_text()
            page_elems = 4 * rows * sc.page_size * cfg.head_dim // data_n  # one layer's K, one shard
            ops = "all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute"
            for dims, op in re.findall(r"= \\w+\\[([\\d,]*)\\]\\S* (" + ops + r")\\(", hlo):
                elems = int(np.prod([int(v) for v in dims.split(",") if v]))
                assert elems < page_elems * cfg.num_key_value_heads, (name, op, dims)
            print(name, data_n, tensor_n, "ok", flush=True)
            jax.clear_caches()

    # a converted (orbax) checkpoint restores straight into the tensor-parallel shardings
    import tempfile
    from mtp_jax.checkpoint.convert import convert
    src = os.path.join(root, "llama3_gqa42")
    with tempfile.TemporaryDirectory() as tmp:
        convert(src, os.path.join(tmp, "orbax"), progress=False)
        mesh = mtp_jax.make_mesh(data=4, tensor=2)
        restored = mtp_jax.load(os.path.join(tmp, "orbax"), "float32", mesh=mesh)
        hub = mtp_jax.load(src, "float32", mesh=mesh)
        for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(hub.params)):
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        ids = np.load(os.path.join(src, "reference.npz"))["input_ids"]
        want = mtp_jax.load(src, "float32").logits(ids)
        np.testing.assert_allclose(restored.logits(ids), want, rtol=2e-5, atol=2e-5)
    print("TP-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(TP_CHILD, FIXTURES)
def test_tensor_parallel_llama_matches_one_device(child_output):
    assert "TP-OK" in child_output


def test_parameter_logical_axes():
    assert param_logical("layers", ["attn", "q"], 3) == (None, "heads", None)
    assert param_logical("layers", ["attn", "k"], 3) == (None, "kv_heads", None)
    assert param_logical("layers", ["attn", "o"], 3) == ("heads", None, None)
    assert param_logical("layers", ["mlp", "gate"], 2) == (None, "ffn")
    assert param_logical("layers", ["mlp", "down"], 2) == ("ffn", None)
    assert param_logical("layers", ["input_norm"], 1) == (None,)
    assert param_logical("lm_head", [], 2) == (None, "vocab")
    assert param_logical("embed", [], 2) == (None, None)
    assert param_logical("moe", ["mlp", "gate", "fp8"], 3) == ("experts", None, None)
    assert param_logical("dense", ["mlp", "gate"], 2) == (None, None)  # DeepSeek: replicated
    import mtp_jax.drafts  # noqa: F401  (the drafts register their groups' layouts)

    assert param_logical("eagle3", ["attn", "q"], 3) == (None, "heads", None)
    assert param_logical("eagle3", ["lm_head"], 2) == (None, "vocab")
    assert param_logical("eagle3", ["fc"], 2) == (None, None)
    assert param_logical("dflash", ["layers", "mlp", "up"], 3) == (None, None, "ffn")
    assert param_logical("dflash", ["fc"], 2) == (None, None)


def test_tensor_split_rules():
    check_tensor_split(32, 8, 8)  # KV heads split
    check_tensor_split(64, 8, 16)  # KV heads replicated, two devices per KV head
    with pytest.raises(ValueError, match="does not divide the 12 attention heads"):
        check_tensor_split(12, 4, 8)
    with pytest.raises(ValueError, match="one must divide the other"):
        check_tensor_split(24, 6, 4)


class FakeMesh:
    """Only the axis names and sizes the mesh checks read (this process has one device)."""

    axis_names = ("data", "expert", "tensor")

    def __init__(self, **shape: int) -> None:
        self.shape = {"data": 1, "expert": 1, "tensor": 1, **shape}


def test_meshes_a_model_cannot_use_are_refused():
    from mtp_jax.config import load_config
    from mtp_jax.targets import target_for

    llama = load_config(os.path.join(FIXTURES, "llama3_gqa42"))  # 4 heads, 2 KV heads
    check = target_for(llama).check_mesh
    with pytest.raises(ValueError, match="Llama has no experts"):
        check(llama, FakeMesh(expert=2))
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        check(llama, FakeMesh(tensor=8))
    check(llama, FakeMesh(data=2, tensor=4))
    deepseek = load_config(os.path.join(REPO, "tests", "fixtures", "parity", "base"))
    with pytest.raises(ValueError, match="tensor parallelism is for Llama"):
        target_for(deepseek).check_mesh(deepseek, FakeMesh(tensor=2))
