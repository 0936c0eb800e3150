"""MoE routing and expert compute against a per-token numpy loop written from the DeepSeek-V3 recipe."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.model import moe
from mtp_jax.targets.deepseek_v3.moe import (
    resolve_dispatch,
    route,
    routed_experts,
    routed_experts_dense,
    routed_experts_gathered,
)
from tests.conftest import TINY_CONFIG


def reference_route(x, router, bias, cfg):
    """One token at a time, plain Python over groups and experts."""
    n_exp = cfg.n_routed_experts
    per_group = n_exp // cfg.n_group
    out_w, out_i = [], []
    for row in x.astype(np.float64):
        s = 1.0 / (1.0 + np.exp(-(row @ router)))
        biased = s + bias
        group_scores = [sorted(biased[g * per_group : (g + 1) * per_group])[-2:] for g in range(cfg.n_group)]
        group_scores = [sum(v) for v in group_scores] if per_group > 1 else list(biased)
        kept = sorted(range(cfg.n_group), key=lambda g: -group_scores[g])[: cfg.topk_group]
        eligible = [e for e in range(n_exp) if e // per_group in kept]
        chosen = sorted(eligible, key=lambda e: -biased[e])[: cfg.num_experts_per_tok]
        w = np.array([s[e] for e in chosen])
        if cfg.norm_topk_prob:
            w = w / w.sum()
        out_w.append(w * cfg.routed_scaling_factor)
        out_i.append(chosen)
    return np.array(out_w), np.array(out_i)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3, "norm_topk_prob": False},
        {"n_group": 2, "topk_group": 1, "n_routed_experts": 10, "num_experts_per_tok": 3},
    ],
)
def test_route_matches_reference(overrides):
    cfg = dataclasses.replace(DeepseekV3Config.from_dict(TINY_CONFIG), **overrides)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, cfg.hidden_size)).astype(np.float32)
    router = rng.standard_normal((cfg.hidden_size, cfg.n_routed_experts)).astype(np.float32) * 0.3
    # a bias large enough to change selections, so selecting by unbiased scores would fail
    bias = rng.standard_normal(cfg.n_routed_experts).astype(np.float32) * 0.5
    w, idx = route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg)
    rw, ri = reference_route(x, router, bias, cfg)
    order, rorder = np.argsort(np.asarray(idx), -1), np.argsort(ri, -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(idx), order, -1), np.take_along_axis(ri, rorder, -1)
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(w), order, -1), np.take_along_axis(rw, rorder, -1), rtol=1e-5
    )


def test_masked_groups_lose_even_to_negative_scores():
    """Groups outside topk_group are -inf, not 0: with negative biased scores a zero mask would win."""
    cfg = dataclasses.replace(DeepseekV3Config.from_dict(TINY_CONFIG), n_group=4, topk_group=1)
    x = np.zeros((1, cfg.hidden_size), np.float32)
    router = np.zeros((cfg.hidden_size, cfg.n_routed_experts), np.float32)
    bias = np.full(cfg.n_routed_experts, -5.0, np.float32)
    bias[2:4] = -4.0  # group 1 is best; every biased score is negative
    _, idx = route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg)
    assert sorted(np.asarray(idx)[0].tolist()) == [2, 3]


@pytest.mark.parametrize("kernels", ["", "interpret", "reference"])
def test_routed_experts_match_loop(monkeypatch, kernels):
    """The sorted path goes through the kernel dispatcher: by default ragged_dot here, and the Pallas
    grouped matmul (interpreted) or the dispatcher's reference when MTP_JAX_KERNELS forces them."""
    monkeypatch.setenv("MTP_JAX_KERNELS", kernels)
    rng = np.random.default_rng(1)
    n, d, f, e, k = 37, 8, 5, 6, 3
    x = rng.standard_normal((n, d)).astype(np.float32)
    gate, up = rng.standard_normal((2, e, d, f)).astype(np.float32)
    down = rng.standard_normal((e, f, d)).astype(np.float32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    idx[:, 0] = 4  # a popular expert; expert 5 may be idle
    w = rng.random((n, k)).astype(np.float32)
    want = np.zeros_like(x, dtype=np.float64)
    for i in range(n):
        for j in range(k):
            ex = idx[i, j]
            g, u = x[i] @ gate[ex], x[i] @ up[ex]
            want[i] += w[i, j] * ((g / (1 + np.exp(-g)) * u) @ down[ex])
    for impl in (routed_experts, routed_experts_dense, routed_experts_gathered):
        got = np.asarray(impl(*map(jnp.asarray, (x, w, idx, gate, up, down))))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=impl.__name__)


def test_gathered_experts_skip_ids_out_of_range_and_take_fp8():
    """Ids >= E (expert parallelism's copies routed to another device) add nothing, whatever their
    weight; FP8 experts are dequantised after the gather, as the sorted path dequantises them all."""
    from mtp_jax.fp8 import Fp8Weight

    rng = np.random.default_rng(3)
    n, d, f, e, k = 5, 16, 8, 4, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    idx = np.asarray(rng.integers(0, e, (n, k)), np.int32)
    gate, up = (jnp.asarray(rng.standard_normal((e, d, f)), jnp.float8_e4m3fn) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((e, f, d)), jnp.float8_e4m3fn)

    def fp8(a, block):
        scales = rng.random((e, -(-a.shape[1] // block[0]), -(-a.shape[2] // block[1]))) * 0.1 + 0.01
        return Fp8Weight(w=a, scale_inv=jnp.asarray(scales, jnp.float32), shape=a.shape[1:], block=block)

    weights = (fp8(gate, (8, 4)), fp8(up, (8, 4)), fp8(down, (4, 8)))
    want = routed_experts(x, w, jnp.asarray(idx), *weights)
    np.testing.assert_allclose(
        routed_experts_gathered(x, w, jnp.asarray(idx), *weights), want, rtol=1e-5, atol=1e-5
    )
    elsewhere = idx.copy()
    elsewhere[:, 1] = e  # the second copy of every token went to another device
    only_first = routed_experts(x, w.at[:, 1].set(0.0), jnp.asarray(idx), *weights)
    got = routed_experts_gathered(x, w, jnp.asarray(elsewhere), *weights)
    np.testing.assert_allclose(got, only_first, rtol=1e-5, atol=1e-5)


def test_moe_block_adds_shared_experts():
    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    rng = np.random.default_rng(2)
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    p = {
        "router": rng.standard_normal((d, e)).astype(np.float32),
        "bias": rng.standard_normal(e).astype(np.float32) * 0.1,
        "gate": rng.standard_normal((e, d, f)).astype(np.float32) * 0.2,
        "up": rng.standard_normal((e, d, f)).astype(np.float32) * 0.2,
        "down": rng.standard_normal((e, f, d)).astype(np.float32) * 0.2,
        "shared_gate": rng.standard_normal((d, f)).astype(np.float32) * 0.2,
        "shared_up": rng.standard_normal((d, f)).astype(np.float32) * 0.2,
        "shared_down": rng.standard_normal((f, d)).astype(np.float32) * 0.2,
    }
    x = rng.standard_normal((2, 5, d)).astype(np.float32)
    params = {k: jnp.asarray(v) for k, v in p.items()}
    full, load = moe(params, jnp.asarray(x), cfg)
    full = np.asarray(full)
    no_shared = dataclasses.replace(cfg, n_shared_experts=0)
    routed = np.asarray(moe(params, jnp.asarray(x), no_shared)[0])
    assert load.shape == (e,) and float(load.sum()) == 2 * 5 * cfg.num_experts_per_tok
    # on this CPU: fewer token copies than experts gather, other tiny sizes run dense
    assert resolve_dispatch("auto", 3, 8, 8, 8, k=2) == "gather"
    assert resolve_dispatch("auto", 4, 8, 8, 8, k=2) == "dense"
    assert resolve_dispatch("auto", 4, 7168, 2048, 256, k=8) == "gather"  # DeepSeek-V3 decode
    assert resolve_dispatch("auto", 4096, 7168, 2048, 256, k=8) == "sorted"  # DeepSeek-V3 prefill
    with pytest.raises(ValueError, match="dispatch"):
        moe(params, jnp.asarray(x), cfg, "ragged")
    g, u = x @ p["shared_gate"], x @ p["shared_up"]
    shared = (g / (1 + np.exp(-g)) * u) @ p["shared_down"]
    np.testing.assert_allclose(full - routed, shared, rtol=1e-4, atol=1e-5)


def test_sorted_path_uses_the_kernel_dispatcher(monkeypatch):
    monkeypatch.setenv("MTP_JAX_KERNELS", "bogus")  # only the dispatcher reads (and refuses) it
    x, w = jnp.ones((3, 4)), jnp.ones((3, 2))
    idx = jnp.zeros((3, 2), jnp.int32)
    gate, down = jnp.ones((2, 4, 5)), jnp.ones((2, 5, 4))
    with pytest.raises(ValueError, match="MTP_JAX_KERNELS"):
        routed_experts(x, w, idx, gate, gate, down)
