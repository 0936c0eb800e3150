"""Random checkpoints in the exact hub layout, for tests, benchmarks and the placeholder default.

``hub_tensors`` draws every tensor a DeepSeek-V3 checkpoint has (MTP layers included when the
config asks for them), ``llama_hub_tensors`` every tensor of a Llama 3 one, ``eagle3_hub_tensors``
those of an EAGLE-3 draft, and
``write_hub_checkpoint`` writes a directory the way the hub does:
config.json plus one safetensors file, or several with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from mtp_jax.checkpoint.hub_layout import vocab_map_tensors
from mtp_jax.checkpoint.safetensors_io import INDEX_NAME, save_safetensors
from mtp_jax.config import DeepseekV3Config, DFlashConfig, Eagle3Config, Llama3Config
from mtp_jax.targets.deepseek_v3.model import iter_hub, layer_leaves, mtp_leaves
from mtp_jax.targets.llama.model import target_layer_leaves


def layer_tensors(
    cfg: DeepseekV3Config, i: int, rng: np.random.Generator, std: float
) -> dict[str, np.ndarray]:
    """Decoder layer ``i``'s hub tensors (as :func:`mtp_jax.targets.deepseek_v3.model.layer_leaves`
    declares them), drawn in hub order: projections and routers N(0, std), norms 1 + N(0, 0.1),
    correction biases N(0, 0.1)."""
    return _draw(f"model.layers.{i}.", layer_leaves(cfg, moe=i >= cfg.first_k_dense_replace), rng, std)


def _draw(pre: str, leaves: tuple, rng: np.random.Generator, std: float) -> dict[str, np.ndarray]:
    t = {}
    for leaf, j in iter_hub(leaves):
        if leaf.kind == "norm":
            x = 1.0 + 0.1 * rng.standard_normal(leaf.hub_shape)
        elif leaf.kind == "bias":
            x = 0.1 * rng.standard_normal(leaf.hub_shape)
        else:
            x = rng.standard_normal(leaf.hub_shape) * std
        t[pre + leaf.hub.format(e=j)] = x.astype(np.float32)
    return t


def hub_tensors(cfg: DeepseekV3Config, seed: int = 0, std: float = 0.1) -> dict[str, np.ndarray]:
    """Every tensor of a float32 DeepSeek-V3 hub checkpoint, drawn from a seeded normal."""
    rng = np.random.default_rng(seed)
    d, v = cfg.hidden_size, cfg.vocab_size
    tensors = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
    for i in range(cfg.num_hidden_layers):
        tensors.update(layer_tensors(cfg, i, rng, std))
    tensors["model.norm.weight"] = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = (rng.standard_normal((v, d)) * std).astype(np.float32)
    for k in range(cfg.num_nextn_predict_layers):
        n = cfg.num_hidden_layers + k
        pre = f"model.layers.{n}."
        mtp = layer_tensors(cfg, max(n, cfg.first_k_dense_replace), rng, std)
        tensors.update(
            {
                k2.replace(f"model.layers.{max(n, cfg.first_k_dense_replace)}.", pre): x
                for k2, x in mtp.items()
            }
        )
        tensors.update(_draw(pre, mtp_leaves(cfg), rng, std))
        tensors[f"{pre}shared_head.head.weight"] = tensors.get(
            "lm_head.weight", tensors["model.embed_tokens.weight"]
        )
        tensors[f"{pre}embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def llama_hub_tensors(
    cfg: Llama3Config, seed: int = 0, std: float = 0.1, embed_std: float = 1.0
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 Llama-family hub checkpoint (Llama 3, Qwen2, Qwen3: the layer
    tensors :func:`mtp_jax.targets.llama.model.layer_leaves` declares; no ``lm_head.weight`` when tied),
    drawn from a seeded normal (the embedding with ``embed_std``, projections and biases with
    ``std``); norms near 1."""
    rng = np.random.default_rng(seed)
    d, v = cfg.hidden_size, cfg.vocab_size

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": (rng.standard_normal((v, d)) * embed_std).astype(np.float32)}
    leaves = target_layer_leaves(cfg)
    for i in range(cfg.num_hidden_layers):
        for leaf in leaves:  # declared in hub order
            draw = norm if leaf.kind == "norm" else w
            tensors[f"model.layers.{i}.{leaf.hub}"] = draw(*leaf.hub_shape)
    tensors["model.norm.weight"] = norm(d)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = w(v, d)
    return tensors


def _eagle3_attention(cfg: Eagle3Config, pre: str, w: Any, norm: Any) -> dict[str, np.ndarray]:
    """The draft layer's attention tensors (GQA, or MLA with ``cfg.mla``), drawn in key order."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    a = f"{pre}self_attn."
    if cfg.mla is None:
        attn = {
            f"{a}q_proj.weight": w(nh * hd, 2 * h),
            f"{a}k_proj.weight": w(nkv * hd, 2 * h),
            f"{a}v_proj.weight": w(nkv * hd, 2 * h),
            f"{a}o_proj.weight": w(h, nh * hd),
        }
    else:  # DeepSeek's MLA on a 2H input
        m = cfg.mla
        qk, kv, rope = m.qk_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
        attn = {
            f"{a}kv_a_proj_with_mqa.weight": w(kv + rope, 2 * h),
            f"{a}kv_a_layernorm.weight": norm(kv),
            f"{a}kv_b_proj.weight": w(nh * (m.qk_nope_head_dim + m.v_head_dim), kv),
            f"{a}o_proj.weight": w(h, nh * m.v_head_dim),
        }
        if m.q_lora_rank is None:
            attn[f"{a}q_proj.weight"] = w(nh * qk, 2 * h)
        else:
            attn[f"{a}q_a_proj.weight"] = w(m.q_lora_rank, 2 * h)
            attn[f"{a}q_a_layernorm.weight"] = norm(m.q_lora_rank)
            attn[f"{a}q_b_proj.weight"] = w(nh * qk, m.q_lora_rank)
    return attn


def eagle3_hub_tensors(
    cfg: Eagle3Config,
    seed: int = 0,
    std: float = 0.1,
    *,
    layer_prefix: str = "midlayer.",
    draft_ids: np.ndarray | None = None,
    embed: np.ndarray | None = None,
    n_features: int = 3,
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 EAGLE-3 draft in the published layout of ``layer_prefix``
    ("midlayer.", "layers.0." or NeMo's "model.layers.0.", which also prefixes fc, embed_tokens and
    norm with "model."); MLA attention tensors when ``cfg.mla`` is set. ``draft_ids``: the target
    ids of the draft vocabulary (ascending), stored as ``d2t`` offsets and a ``t2d`` mask;
    ``embed``: an ``embed_tokens.weight`` to include."""
    rng = np.random.default_rng(seed)
    h, f = cfg.hidden_size, cfg.intermediate_size
    top = "model." if layer_prefix.startswith("model.") else ""

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    pre = layer_prefix
    tensors = {
        f"{top}fc.weight": w(h, n_features * cfg.target_hidden_size),
        f"{pre}hidden_norm.weight": norm(h),
        f"{pre}input_layernorm.weight": norm(h),
        **_eagle3_attention(cfg, pre, w, norm),
        f"{pre}post_attention_layernorm.weight": norm(h),
        f"{pre}mlp.gate_proj.weight": w(f, h),
        f"{pre}mlp.up_proj.weight": w(f, h),
        f"{pre}mlp.down_proj.weight": w(h, f),
        f"{top}norm.weight": norm(h),
        "lm_head.weight": w(cfg.draft_vocab_size, h),
    }
    if draft_ids is not None:
        tensors.update(vocab_map_tensors(draft_ids, cfg.vocab_size))
    if embed is not None:
        tensors[f"{top}embed_tokens.weight"] = np.asarray(embed, np.float32)
    return tensors


def dflash_hub_tensors(
    cfg: DFlashConfig,
    n_features: int,
    seed: int = 0,
    std: float = 0.1,
    draft_ids: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Every tensor of a float32 DFlash draft in the published layout (no ``model.`` prefix):
    ``fc`` over ``n_features`` target layers, ``hidden_norm``, ``norm`` and ``layers.{i}.*`` with
    Qwen3's ``q_norm`` / ``k_norm``; no embedding and no head. ``draft_ids``: the target ids of a
    draft vocabulary (``d2t``, and ``t2d`` when ``cfg.vocab_size`` is set)."""
    rng = np.random.default_rng(seed)
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"fc.weight": w(h, n_features * h), "hidden_norm.weight": norm(h)}
    for i in range(cfg.num_hidden_layers):
        pre, a = f"layers.{i}.", f"layers.{i}.self_attn."
        tensors.update(
            {
                f"{pre}input_layernorm.weight": norm(h),
                f"{a}q_proj.weight": w(nh * hd, h),
                f"{a}k_proj.weight": w(nkv * hd, h),
                f"{a}v_proj.weight": w(nkv * hd, h),
                f"{a}o_proj.weight": w(h, nh * hd),
                f"{a}q_norm.weight": norm(hd),
                f"{a}k_norm.weight": norm(hd),
                f"{pre}post_attention_layernorm.weight": norm(h),
                f"{pre}mlp.gate_proj.weight": w(f, h),
                f"{pre}mlp.up_proj.weight": w(f, h),
                f"{pre}mlp.down_proj.weight": w(h, f),
            }
        )
    tensors["norm.weight"] = norm(h)
    if draft_ids is not None:
        tensors.update(vocab_map_tensors(draft_ids, cfg.vocab_size))
    return tensors


def write_hub_checkpoint(
    directory: str | os.PathLike[str],
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    shards: int = 1,
    extra_files: Mapping[str, str] | None = None,
) -> None:
    """Write config.json, the tensors (split over ``shards`` files with an index when > 1) and any
    ``extra_files`` (name -> source path) into a new directory, atomically: everything goes to a
    temporary sibling first, which is renamed into place at the end."""
    directory = os.fspath(directory)
    if os.path.exists(directory):
        raise FileExistsError(f"refusing to overwrite existing checkpoint directory {directory}")
    tmp = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(config), f, indent=2)
            f.write("\n")
        keys = list(tensors)
        if shards == 1:
            save_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"})
        else:
            weight_map, total = {}, 0
            for s, part in enumerate(np.array_split(np.arange(len(keys)), shards)):
                name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
                chunk = {keys[j]: tensors[keys[j]] for j in part}
                save_safetensors(os.path.join(tmp, name), chunk, {"format": "pt"})
                weight_map.update({k: name for k in chunk})
                total += sum(x.nbytes for x in chunk.values())
            with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, os.path.join(tmp, name))
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_quantized_in_hub(key: str) -> bool:
    """Whether DeepSeek's FP8 checkpoints store this tensor as FP8 (every projection of a decoder
    layer except the MTP-only ``eh_proj``; never embeddings, heads, norms or the router)."""
    return (
        key.startswith("model.layers.")
        and key.endswith(("_proj.weight", "_proj_with_mqa.weight"))
        and ".eh_proj." not in key
    )


def quantize_fp8(
    tensors: Mapping[str, np.ndarray], block: tuple[int, int] = (128, 128)
) -> dict[str, np.ndarray]:
    """The FP8 hub form of float32 ``tensors``: quantised weights become float8_e4m3fn plus a float32
    ``<name>_scale_inv`` per (b0, b1) block, with scale = max|block| / 448 as DeepSeek does."""
    import ml_dtypes

    fp8_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    out: dict[str, np.ndarray] = {}
    for key, w in tensors.items():
        if not is_quantized_in_hub(key):
            out[key] = w
            continue
        b0, b1 = block
        rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
        scale = np.zeros((rows, cols), np.float32)
        q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                blk = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
                s = max(float(np.abs(blk).max()), 1e-12) / fp8_max
                scale[i, j] = s
                q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
        out[key] = q
        out[f"{key}_scale_inv"] = scale
    return out


def oracle_draft_tensors(cfg: DeepseekV3Config, alpha: float, seed: int = 0) -> dict[str, np.ndarray]:
    """Hub tensors whose MTP layer nearly predicts the target: a draft that gets accepted.

    The target's attention and MLP outputs are scaled by ``alpha`` (0: the target is a bigram model,
    logits = head(norm(embed(t)))). The MTP layer passes the next token's embedding straight
    through (eh_proj = [I, 0], its own attention and MLP zeroed, enorm = 1, shared_head.norm = the
    final norm), so it predicts that bigram exactly; with alpha > 0 the target drifts from it and
    only some drafts are accepted. For tests and benchmarks of the speculative machinery where
    random weights would accept nothing; it says nothing about real draft quality.
    """
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("an oracle draft needs num_nextn_predict_layers >= 1")
    tensors = hub_tensors(cfg, seed=seed)
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    for key in list(tensors):
        if key.startswith("model.layers.") and key.endswith(("o_proj.weight", "down_proj.weight")):
            layer = int(key.split(".")[2])
            tensors[key] = tensors[key] * (alpha if layer < n else 0.0)
    tensors[f"model.layers.{n}.eh_proj.weight"] = np.concatenate([np.eye(d), np.zeros((d, d))], 1).astype(
        np.float32
    )
    tensors[f"model.layers.{n}.enorm.weight"] = np.ones(d, np.float32)
    tensors[f"model.layers.{n}.shared_head.norm.weight"] = tensors["model.norm.weight"].copy()
    return tensors


def write_lora_adapter(
    path: str | os.PathLike[str],
    cfg: Any,
    rank: int,
    modules: list[str],
    seed: int,
    alpha: float | None = None,
    b_std: float | None = None,
) -> str:
    """A PEFT LoRA adapter directory for a model of config ``cfg`` with random A and B on every
    layer's ``modules`` (the last part of hub module names, e.g. "q_proj"), in the layout peft
    writes: A ~ N(0, 1/fan_in), B ~ N(0, ``b_std``**2) (default 1/rank), ``lora_alpha`` ``alpha``
    (default 2 rank)."""
    from mtp_jax.targets import target_for

    rng = np.random.default_rng(seed)
    b_std = rank**-0.5 if b_std is None else b_std
    tensors = {}
    for site in target_for(cfg).lora_sites(cfg):
        if site.module.rsplit(".", 1)[-1] not in modules:
            continue
        for layer in range(site.count):
            key = f"base_model.model.model.layers.{site.first + layer}.{site.module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, site.fan_in**-0.5, (rank, site.fan_in)).astype(
                np.float32
            )
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, b_std, (site.fan_out, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": modules}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({**config, "bias": "none"}, f)
    save_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    return os.fspath(path)
