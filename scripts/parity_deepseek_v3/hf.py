"""The transformers side: the loaded model checked against the numpy weights and the rotary setup,
and the reference forward, greedy generation and MTP outputs it produces."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoConfig, DeepseekV3ForCausalLM
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

from .numpy_reference import max_rel_err, reference_yarn, routing_margin
from .specs import GREEDY_GAP, GREEDY_NEW, ROUTING_MARGIN

HIDDEN_STATES_DOC = (
    "hidden_states[k], k=0..L (L=num_hidden_layers), from transformers "
    f"{transformers.__version__} DeepseekV3ForCausalLM(output_hidden_states=True): k=0 is the token "
    "embedding (input of layer 0); 1<=k<L is the output of decoder layer k-1 (residual stream, no norm); "
    "k=L is the output of the last decoder layer AFTER the final model.norm RMSNorm, i.e. equal to "
    "last_hidden_post_norm (the pre-norm output of the last layer is layer_outputs[L-1])."
)

MTP_DOC = (
    "mtp_logits [B,T-1,V], mtp_hidden [B,T-1,H], mtp_block_output [B,T-1,H]: the NextN/MTP layer "
    "model.layers.N (N=num_hidden_layers) run teacher-forced over the pairs (h_i, t_{i+1}), i=0..T-2, "
    "where t=input_ids and h=last_hidden_post_norm (= hidden_states[L], the target's last hidden state "
    "AFTER the final model.norm); row i predicts token i+2. x_i = eh_proj(concat([enorm(E[t_{i+1}]), "
    "hnorm(h_i)], -1)) with the embedding FIRST (E = model.embed_tokens.weight = layer N's embed_tokens "
    "copy); mtp_block_output = DeepseekV3DecoderLayer N (MLA + MoE with its own router, bias and shared "
    "expert) over the T-1 rows x_0..x_{T-2}, causal over that sequence only (row i attends rows 0..i; "
    "nothing is masked at position 0), RoPE position of row i = i+1 (the position of t_{i+1}, as "
    "transformers does; position i, as SGLang/vLLM do, gives the same values to ~1e-6 since RoPE is "
    "relative); mtp_hidden = shared_head.norm(mtp_block_output) (RMSNorm, rms_norm_eps); mtp_logits = "
    "mtp_hidden @ shared_head.head.weight^T (= lm_head.weight). Computed with transformers "
    f"{transformers.__version__}: MtpModel.from_pretrained(DeepseekV3ForCausalLM).forward_layer(0, "
    "last_hidden_states=h[:, :T-1], position_ids=1..T-1, mtp_cache=MtpCache(), input_ids=t[:, 1:]) then "
    "MtpModel._project_to_logits (float32, eager); cross-checked against MtpModel.forward (the "
    "generate(use_mtp=True) drafting path) at the last row and against an independent float64 numpy "
    "forward of the DeepSeek MTP equations."
)


# --------------------------------------------------------------------------------------------------- checks


def is_mtp_key(cfg: dict[str, Any], key: str) -> bool:
    """True for keys of the MTP layers ``model.layers.{i}.`` with i >= num_hidden_layers."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= cfg["num_hidden_layers"]


def fused_experts(weights: dict[str, np.ndarray], p: str, n_exp: int) -> dict[str, np.ndarray]:
    """transformers' fused expert tensors for the MoE layer with key prefix ``p``."""
    p += "mlp.experts."
    return {
        p + "gate_up_proj": np.stack(
            [
                np.concatenate([weights[f"{p}{e}.gate_proj.weight"], weights[f"{p}{e}.up_proj.weight"]])
                for e in range(n_exp)
            ]
        ),
        p + "down_proj": np.stack([weights[f"{p}{e}.down_proj.weight"] for e in range(n_exp)]),
    }


def expected_state_dict(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What transformers' module state_dict must hold: hub keys with the experts fused per layer (no MTP)."""
    out: dict[str, np.ndarray] = {}
    for k, v in weights.items():
        if ".mlp.experts." not in k and not is_mtp_key(cfg, k):
            out[k] = v
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        out.update(fused_experts(weights, f"model.layers.{i}.", cfg["n_routed_experts"]))
    return out


def expected_unexpected_keys(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> set[str]:
    """The MTP-layer keys DeepseekV3ForCausalLM.from_pretrained must report as unexpected (experts fused)."""
    out = {k for k in weights if is_mtp_key(cfg, k) and ".mlp.experts." not in k}
    for i in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        out |= {f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"}
    return out


def expected_mtp_state_dict(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What transformers' MtpModel state_dict must hold for the hub's ``model.layers.{N}.*`` keys."""
    p = f"model.layers.{cfg['num_hidden_layers']}."
    renamed = {
        "enorm.weight": "layers.0.enorm.weight",
        "hnorm.weight": "layers.0.hnorm.weight",
        "eh_proj.weight": "layers.0.eh_proj.weight",
        "shared_head.norm.weight": "layers.0.post_norm.weight",
        "shared_head.head.weight": "shared_head.weight",
        "embed_tokens.weight": "embed_tokens.weight",
    }
    out: dict[str, np.ndarray] = {}
    for k, v in weights.items():
        if k.startswith(p) and ".mlp.experts." not in k:
            rest = k[len(p) :]
            out[renamed.get(rest, "layers.0.mtp_block." + rest)] = v
    for k, v in fused_experts(weights, p, cfg["n_routed_experts"]).items():
        out["layers.0.mtp_block." + k[len(p) :]] = v
    return out


def check_loaded(
    model: DeepseekV3ForCausalLM, info: dict[str, Any], cfg: dict[str, Any], weights: dict[str, np.ndarray]
) -> None:
    """Fail unless every tensor of the model equals the numpy weights bit for bit.

    The only keys allowed to stay unloaded are those of the MTP layer, and all of them must be reported.
    """
    for kind in ("missing_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            raise RuntimeError(f"from_pretrained reported {kind}: {info[kind]}")
    unexpected, want = set(info.get("unexpected_keys") or ()), expected_unexpected_keys(cfg, weights)
    if unexpected != want:
        raise RuntimeError(
            f"from_pretrained unexpected keys {sorted(unexpected)} != the MTP layer's keys {sorted(want)}"
        )
    expected = expected_state_dict(cfg, weights)
    state = model.state_dict()
    if set(state) != set(expected):
        raise RuntimeError(
            f"state_dict keys differ: model-only {sorted(set(state) - set(expected))}, "
            f"checkpoint-only {sorted(set(expected) - set(state))}"
        )
    for k, ref in expected.items():
        got = state[k].detach().cpu()
        if got.dtype != torch.float32:
            raise RuntimeError(f"{k}: loaded as {got.dtype}, expected float32")
        if tuple(got.shape) != ref.shape or not np.array_equal(got.numpy(), ref):
            raise RuntimeError(f"{k}: loaded tensor differs from the checkpoint")


def check_config(model: DeepseekV3ForCausalLM, cfg: dict[str, Any]) -> dict[str, Any]:
    """Check transformers parsed config.json as intended (incl. yarn); return facts for the README."""
    c = model.config
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "norm_topk_prob",
        "routed_scaling_factor",
        "rms_norm_eps",
        "moe_intermediate_size",
    ):
        if getattr(c, key) != cfg[key]:
            raise RuntimeError(f"config.{key}: transformers read {getattr(c, key)!r}, file has {cfg[key]!r}")
    if c.rope_interleave is not True:
        raise RuntimeError(
            "expected rope_interleave=True (transformers' default for hub DeepSeek-V3 configs)"
        )
    rotary = model.model.rotary_emb
    want_type = "default" if cfg["rope_scaling"] is None else "yarn"
    if rotary.rope_type != want_type:
        raise RuntimeError(f"rotary_emb.rope_type is {rotary.rope_type!r}, expected {want_type!r}")
    if c.rope_parameters["rope_theta"] != cfg["rope_theta"]:
        raise RuntimeError(f"rope_theta read as {c.rope_parameters['rope_theta']}")
    inv_freq, attn_factor, softmax_scale = reference_yarn(cfg)
    got_inv = rotary.inv_freq.double().numpy()
    if not np.allclose(got_inv, inv_freq, rtol=1e-6, atol=0):
        raise RuntimeError(f"inv_freq {got_inv} != reference {inv_freq}")
    if not math.isclose(rotary.attention_scaling, attn_factor, rel_tol=1e-9):
        raise RuntimeError(f"rotary attention_scaling {rotary.attention_scaling} != {attn_factor}")
    for layer in model.model.layers:
        attn = layer.self_attn
        if not math.isclose(attn.scaling, softmax_scale, rel_tol=1e-9):
            raise RuntimeError(f"softmax scaling {attn.scaling} != {softmax_scale}")
        if attn.kv_a_layernorm.variance_epsilon != 1e-6:
            raise RuntimeError("kv_a_layernorm eps is not 1e-6")
        if attn.q_a_layernorm is not None and attn.q_a_layernorm.variance_epsilon != 1e-6:
            raise RuntimeError("q_a_layernorm eps is not 1e-6")
        if layer.input_layernorm.variance_epsilon != cfg["rms_norm_eps"]:
            raise RuntimeError("input_layernorm eps differs from rms_norm_eps")
    if model.model.norm.variance_epsilon != cfg["rms_norm_eps"]:
        raise RuntimeError("final norm eps differs from rms_norm_eps")
    return {
        "rope_type": rotary.rope_type,
        "inv_freq": [float(x) for x in got_inv],
        "cos_sin_attention_factor": float(rotary.attention_scaling),
        "softmax_scale": float(model.model.layers[0].self_attn.scaling),
        "softmax_scale_without_mscale": (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5,
    }


# --------------------------------------------------------------------------------------------------- forward


def run_greedy(
    model: DeepseekV3ForCausalLM, input_ids: np.ndarray, biases: list[np.ndarray], cfg: dict[str, Any]
) -> np.ndarray | None:
    """transformers' greedy ``generate`` (its KV cache, no EOS) from the first half of ``input_ids``:
    [B, P + GREEDY_NEW], or None when a routing decision or a greedy choice along the generated text
    (recomputed teacher-forced) is too close for a correct float32 implementation to be sure of it."""
    p = input_ids.shape[1] // 2
    model.generation_config.eos_token_id = None  # never stop early: N tokens, nothing masked
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(input_ids[:, :p].astype(np.int64)),
            attention_mask=torch.ones((input_ids.shape[0], p), dtype=torch.long),
            max_new_tokens=GREEDY_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    tokens = out.numpy()
    ref = run_reference(model, tokens)
    chosen = ref["logits"][:, p - 1 : -1]
    if not np.array_equal(chosen.argmax(-1), tokens[:, p:]):
        raise RuntimeError("generate's tokens are not the teacher-forced argmax of its own text")
    top2 = np.sort(chosen, axis=-1)[..., -2:]
    router = ref["router_logits"]  # the main layers' (an MTP layer's bias comes last in biases)
    margins = [routing_margin(r, b, cfg) for r, b in zip(router, biases[: len(router)], strict=True)]
    gap = float((top2[..., 1] - top2[..., 0]).min())
    if gap < GREEDY_GAP or min(margins, default=math.inf) < ROUTING_MARGIN:
        return None
    return tokens


def run_reference(model: DeepseekV3ForCausalLM, input_ids: np.ndarray) -> dict[str, Any]:
    """Teacher-forced forward; returns all reference arrays plus the router logits of every MoE layer."""
    layer_out: list[torch.Tensor] = []
    router_logits: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, o: layer_out.append(o.detach().clone()))
        for layer in model.model.layers
    ]
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:  # DeepseekV3TopkRouter returns (router_logits, topk_weights, topk_indices)
            hooks.append(
                gate.register_forward_hook(lambda _m, _i, o: router_logits.append(o[0].detach().clone()))
            )
    ids = torch.from_numpy(input_ids.astype(np.int64))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        post_norm = model.model(input_ids=ids, use_cache=False).last_hidden_state
    hs = [h.detach().numpy() for h in out.hidden_states]
    n_layers = len(model.model.layers)
    layers_np = np.stack([t.numpy() for t in layer_out])
    emb = model.model.embed_tokens.weight.detach().numpy()[input_ids]
    # Pin the hidden_states convention documented in HIDDEN_STATES_DOC.
    if len(hs) != n_layers + 1 or len(layer_out) != n_layers:
        raise RuntimeError(f"unexpected hidden_states length {len(hs)} for {n_layers} layers")
    if not np.array_equal(hs[0], emb):
        raise RuntimeError("hidden_states[0] is not the token embedding")
    for k in range(1, n_layers):
        if not np.array_equal(hs[k], layers_np[k - 1]):
            raise RuntimeError(f"hidden_states[{k}] is not the output of layer {k - 1}")
    if not np.array_equal(hs[n_layers], post_norm.numpy()):
        raise RuntimeError("hidden_states[L] is not last_hidden_state (post final norm)")
    if np.array_equal(hs[n_layers], layers_np[-1]):
        raise RuntimeError("hidden_states[L] unexpectedly equals the pre-norm last layer output")
    logits = out.logits.detach().numpy()
    lm = model.lm_head.weight.detach().numpy()
    if not np.allclose(logits, post_norm.numpy() @ lm.T, rtol=1e-5, atol=1e-5):
        raise RuntimeError("logits are not lm_head(last_hidden_state)")
    return {
        "logits": logits.astype(np.float32),
        "hidden_states": np.stack(hs).astype(np.float32),
        "last_hidden_post_norm": post_norm.numpy().astype(np.float32),
        "layer_outputs": layers_np.astype(np.float32),
        "router_logits": [r.numpy() for r in router_logits],
    }


def load_mtp(model: DeepseekV3ForCausalLM, cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> MtpModel:
    """transformers' generic MtpModel for layer N of ``model``'s checkpoint, checked tensor by tensor."""
    if cfg["num_nextn_predict_layers"] != 1 or model.config.num_mtp_layers != 1:
        raise RuntimeError(
            "only one MTP layer is supported (num_nextn_predict_layers = 1, as in DeepSeek-V3)"
        )
    n = cfg["num_hidden_layers"]
    # DeepseekV3 registers only r"model\.layers\.61.*" (the real V3's MTP layer) as the MTP key pattern, and
    # MtpModel.from_pretrained finds the MTP weights through it: point it at layer N of this tiny model.
    model._keys_to_ignore_on_load_unexpected = {rf"model\.layers\.{n}\..*"}
    mtp = MtpModel.from_pretrained(model)
    mtp.eval()
    if mtp.embed_tokens is not model.model.embed_tokens or mtp.shared_head is not model.lm_head:
        raise RuntimeError("MtpModel does not share the main model's embedding / lm_head")
    if (
        not mtp.use_post_norm
        or mtp.use_shared_post_norm
        or getattr(mtp.config, "mtp_hidden_states_first", False)
    ):
        raise RuntimeError("MtpModel is not in the DeepSeek configuration (post_norm, embedding first)")
    p = f"model.layers.{n}."
    for copy, main in (
        ("shared_head.head.weight", "lm_head.weight"),
        ("embed_tokens.weight", "model.embed_tokens.weight"),
    ):
        if not np.array_equal(weights[p + copy], weights[main]):
            raise RuntimeError(f"{p}{copy} is not an exact copy of {main}")
    expected = expected_mtp_state_dict(cfg, weights)
    state = mtp.state_dict()
    if set(state) != set(expected):
        raise RuntimeError(
            f"MtpModel keys differ: model-only {sorted(set(state) - set(expected))}, "
            f"checkpoint-only {sorted(set(expected) - set(state))}"
        )
    for k, ref in expected.items():
        got = state[k].detach().cpu()
        if (
            got.dtype != torch.float32
            or tuple(got.shape) != ref.shape
            or not np.array_equal(got.numpy(), ref)
        ):
            raise RuntimeError(f"MtpModel {k}: loaded tensor differs from the checkpoint")
    return mtp


def run_mtp_reference(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, input_ids: np.ndarray, h_post: np.ndarray
) -> dict[str, Any]:
    """MTP layer over positions 0..T-2 (see MTP_DOC); returns the reference arrays and its router logits."""
    ids = torch.from_numpy(input_ids.astype(np.int64))
    h = torch.from_numpy(h_post)
    batch, seq = ids.shape
    layer = mtp.layers[0]
    block_out: list[torch.Tensor] = []
    router_logits: list[torch.Tensor] = []

    def positions(first: int) -> torch.Tensor:
        return torch.arange(first, first + seq - 1)[None].expand(batch, -1)

    def mtp_step(first: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = MtpCache(config=model.config.get_mtp_config())
        hidden = mtp.forward_layer(0, h[:, :-1], positions(first), cache, input_ids=ids[:, 1:])
        return hidden, mtp._project_to_logits(hidden)

    hooks = [
        layer.mtp_block.register_forward_hook(lambda _m, _i, o: block_out.append(o.detach().clone())),
        layer.mtp_block.mlp.gate.register_forward_hook(
            lambda _m, _i, o: router_logits.append(o[0].detach().clone())
        ),
    ]
    try:
        with torch.no_grad():
            hidden, logits = mtp_step(1)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        # SGLang / vLLM give the MTP row of h_i the rope position i, transformers i + 1: RoPE is relative.
        hidden_at_i, logits_at_i = mtp_step(0)
        # The drafting path of generate(use_mtp=True) (MTPCandidateGenerator) after a prefill over input_ids.
        _, draft_logits, _ = mtp(
            input_ids=ids[:, 1:],
            last_hidden_states=h[:, :-1],
            attention_mask=None,
            position_ids=positions(1),
            mtp_cache=MtpCache(config=model.config.get_mtp_config()),
        )
        renormed = layer.post_norm(block_out[0])
    if len(block_out) != 1 or not torch.equal(renormed, hidden):
        raise RuntimeError("MTP hidden state is not shared_head.norm (post_norm) of the MTP block output")
    lm = model.lm_head.weight.detach().numpy()
    if not np.allclose(logits.numpy(), hidden.numpy() @ lm.T, rtol=1e-5, atol=1e-5):
        raise RuntimeError("MTP logits are not lm_head(mtp_hidden)")
    shift_err = max_rel_err(logits_at_i.numpy(), logits.numpy().astype(np.float64))
    shift_err = max(shift_err, max_rel_err(hidden_at_i.numpy(), hidden.numpy().astype(np.float64)))
    if shift_err > 1e-5:
        raise RuntimeError(f"MTP output depends on the absolute rope offset (rel. err {shift_err})")
    draft_err = max_rel_err(draft_logits[:, 0].numpy(), logits[:, -1].numpy().astype(np.float64))
    if draft_err > 1e-5:
        raise RuntimeError(f"MtpModel.forward (drafting path) disagrees with forward_layer ({draft_err})")
    return {
        "mtp_logits": logits.numpy().astype(np.float32),
        "mtp_hidden": hidden.numpy().astype(np.float32),
        "mtp_block_output": block_out[0].numpy().astype(np.float32),
        "router_logits": [r.numpy() for r in router_logits],
        "rope_shift_rel_err": shift_err,
        "draft_path_rel_err": draft_err,
    }


def check_hub_config(dst: Path, cfg: dict[str, Any]) -> None:
    """transformers must read the fixture's own config.json (MTP layer count, FP8 block) as written."""
    c = AutoConfig.from_pretrained(str(dst))
    if c.num_mtp_layers != cfg["num_nextn_predict_layers"]:
        raise RuntimeError(f"num_nextn_predict_layers read as num_mtp_layers={c.num_mtp_layers}")
    quant = cfg.get("quantization_config")
    got = getattr(c, "quantization_config", None)
    got = got.to_dict() if hasattr(got, "to_dict") else got
    if quant is not None and {k: got.get(k) for k in quant} != quant:
        raise RuntimeError(f"quantization_config read as {got}")
