"""An independent float64 numpy forward of the DeepSeek-V3 equations (and its MTP layer), and the
routing margin of a router's logits: what every transformers reference must agree with."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def reference_yarn(cfg: dict[str, Any]) -> tuple[np.ndarray, float, float]:
    """Independent float64 recomputation of (inv_freq, cos/sin factor, softmax scale), DeepSeek-V3 style."""
    dim, base = cfg["qk_rope_head_dim"], float(cfg["rope_theta"])
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rs = cfg["rope_scaling"]
    if rs is None:
        return freqs, 1.0, scale

    def mscale(s: float, m: float) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    def corr_dim(rot: float) -> float:
        orig = rs["original_max_position_embeddings"]
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    factor = rs["factor"]
    low = max(math.floor(corr_dim(rs["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(rs["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_freq = freqs / factor * ramp + freqs * (1 - ramp)
    attn_factor = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
    m = mscale(factor, rs["mscale_all_dim"])
    return inv_freq, attn_factor, scale * m * m


def routing_margin(router_logits: np.ndarray, bias: np.ndarray, cfg: dict[str, Any]) -> float:
    """Smallest gap between the last selected and the first rejected group / expert (float64 recompute)."""
    n_group, topk_group, top_k = cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]
    n_exp = cfg["n_routed_experts"]
    scores = 1.0 / (1.0 + np.exp(-router_logits.astype(np.float64)))
    choice = scores + bias.astype(np.float64)
    grouped = choice.reshape(-1, n_group, n_exp // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    margin = math.inf
    if topk_group < n_group:
        gs = np.sort(group_scores, axis=-1)[:, ::-1]
        margin = min(margin, float((gs[:, topk_group - 1] - gs[:, topk_group]).min()))
    keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    masked = np.where(np.repeat(mask, n_exp // n_group, axis=-1), choice, -np.inf)
    ms = np.sort(masked, axis=-1)[:, ::-1]
    if top_k < topk_group * (n_exp // n_group):
        margin = min(margin, float((ms[:, top_k - 1] - ms[:, top_k]).min()))
    return margin


# ------------------------------------------------------------------------------ independent float64 forward


def np_rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def np_mlp(w: dict[str, np.ndarray], p: str, x: np.ndarray) -> np.ndarray:
    gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
    return (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "down_proj.weight"].T


def np_moe(w: dict[str, np.ndarray], p: str, cfg: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """DeepSeek-V3 noaux_tc routing (sigmoid, bias for the choice only, group top-2 sums) + shared experts."""
    n_exp, n_group, top_k = cfg["n_routed_experts"], cfg["n_group"], cfg["num_experts_per_tok"]
    flat = x.reshape(-1, x.shape[-1])
    scores = 1.0 / (1.0 + np.exp(-(flat @ w[p + "mlp.gate.weight"].T)))
    choice = scores + w[p + "mlp.gate.e_score_correction_bias"]
    group_scores = np.sort(choice.reshape(len(flat), n_group, -1), axis=-1)[..., -2:].sum(-1)
    groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, : cfg["topk_group"]]
    keep = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(keep, groups, True, axis=-1)
    masked = np.where(np.repeat(keep, n_exp // n_group, axis=-1), choice, -np.inf)
    idx = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(scores, idx, axis=-1)
    if cfg["norm_topk_prob"]:
        weight = weight / weight.sum(-1, keepdims=True)
    weight = weight * cfg["routed_scaling_factor"]
    out = np_mlp(w, p + "mlp.shared_experts.", flat)
    for e in range(n_exp):
        rows, slot = np.nonzero(idx == e)
        out[rows] += weight[rows, slot, None] * np_mlp(w, p + f"mlp.experts.{e}.", flat[rows])
    return out.reshape(x.shape)


def np_attention(
    w: dict[str, np.ndarray], p: str, cfg: dict[str, Any], x: np.ndarray, pos: np.ndarray
) -> np.ndarray:
    """MLA, expanded form, causal over the S rows of x [B, S, H] at rope positions pos [S]."""
    b, s, _ = x.shape
    heads, nope, vdim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv_lora = cfg["kv_lora_rank"]
    a = p + "self_attn."
    if cfg["q_lora_rank"] is None:
        q = x @ w[a + "q_proj.weight"].T
    else:
        q = (
            np_rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6)
            @ w[a + "q_b_proj.weight"].T
        )
    q = q.reshape(b, s, heads, -1)
    kv_a = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    latent = np_rms(kv_a[..., :kv_lora], w[a + "kv_a_layernorm.weight"], 1e-6)
    kv = (latent @ w[a + "kv_b_proj.weight"].T).reshape(b, s, heads, nope + vdim)
    inv_freq, attn_factor, scale = reference_yarn(cfg)
    angle = pos[:, None, None] * inv_freq  # [S, 1, rope/2]
    cos, sin = np.cos(angle) * attn_factor, np.sin(angle) * attn_factor

    def rotate(t: np.ndarray) -> np.ndarray:  # interleaved pairs (t0, t1), (t2, t3), ...
        even, odd = t[..., 0::2], t[..., 1::2]
        return np.concatenate([even * cos - odd * sin, even * sin + odd * cos], axis=-1)

    q_rope, k_rope = rotate(q[..., nope:]), rotate(kv_a[..., None, kv_lora:])
    logits = np.einsum("bshd,bthd->bhst", q[..., :nope], kv[..., :nope])
    logits = (logits + np.einsum("bshd,btkd->bhst", q_rope, k_rope)) * scale
    logits = np.where(np.triu(np.ones((s, s), dtype=bool), 1), -np.inf, logits)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhst,bthd->bshd", probs, kv[..., nope:]).reshape(b, s, heads * vdim)
    return out @ w[a + "o_proj.weight"].T


def np_decoder_layer(
    w: dict[str, np.ndarray], p: str, cfg: dict[str, Any], x: np.ndarray, pos: np.ndarray, moe: bool
) -> np.ndarray:
    eps = cfg["rms_norm_eps"]
    x = x + np_attention(w, p, cfg, np_rms(x, w[p + "input_layernorm.weight"], eps), pos)
    h = np_rms(x, w[p + "post_attention_layernorm.weight"], eps)
    return x + (np_moe(w, p, cfg, h) if moe else np_mlp(w, p + "mlp.", h))


def np_reference(
    weights: dict[str, np.ndarray], cfg: dict[str, Any], input_ids: np.ndarray, h_post: np.ndarray | None
) -> dict[str, np.ndarray]:
    """Float64 numpy forward of the target and, if ``h_post`` is given, of MTP layer N (DeepSeek semantics).

    MTP: x_i = eh_proj(concat[enorm(E[t_{i+1}]), hnorm(h_i)]) for i = 0..T-2 with E = the MTP layer's own
    ``embed_tokens`` copy and h = ``h_post`` (the target's post-final-norm hidden state); decoder layer N over
    those T-1 rows, causal, rope positions 0..T-2 (the positions of h_i; transformers uses i+1, RoPE is
    relative); ``shared_head.norm``; logits with the layer's own ``shared_head.head`` copy.
    """
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    eps, n_layers = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    seq = input_ids.shape[1]
    x = w["model.embed_tokens.weight"][input_ids]
    for i in range(n_layers):
        x = np_decoder_layer(
            w,
            f"model.layers.{i}.",
            cfg,
            x,
            np.arange(seq, dtype=np.float64),
            moe=i >= cfg["first_k_dense_replace"],
        )
    post = np_rms(x, w["model.norm.weight"], eps)
    out = {"logits": post @ w["lm_head.weight"].T, "last_hidden_post_norm": post}
    if h_post is not None:
        p = f"model.layers.{n_layers}."
        emb = np_rms(w[p + "embed_tokens.weight"][input_ids[:, 1:]], w[p + "enorm.weight"], eps)
        hid = np_rms(h_post[:, :-1].astype(np.float64), w[p + "hnorm.weight"], eps)
        x = np.concatenate([emb, hid], axis=-1) @ w[p + "eh_proj.weight"].T
        block = np_decoder_layer(w, p, cfg, x, np.arange(seq - 1, dtype=np.float64), moe=True)
        out["mtp_block_output"] = block
        out["mtp_hidden"] = np_rms(block, w[p + "shared_head.norm.weight"], eps)
        out["mtp_logits"] = out["mtp_hidden"] @ w[p + "shared_head.head.weight"].T
    return out


def max_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


# --------------------------------------------------------------------------------------------------- forward
