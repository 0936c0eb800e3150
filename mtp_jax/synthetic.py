"""Random checkpoints in the exact hub layout, for tests, benchmarks and ``mtp-jax plan``.

Each family and draft draws its own tensors in its folder (``targets/deepseek_v3/synthetic.py``:
``hub_tensors``, MTP layers included when the config asks for them; ``targets/llama/synthetic.py``;
``drafts/eagle3/synthetic.py``; ``drafts/dflash/synthetic.py``); this module writes them the way the
hub does (:func:`mtp_jax.checkpoint.safetensors_io.write_hub_checkpoint`: config.json plus one
safetensors file, or several with a ``model.safetensors.index.json``), quantises them to block FP8
as published checkpoints are, and writes LoRA adapters in peft's layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mtp_jax.checkpoint.safetensors_io import save_safetensors, write_hub_checkpoint

# write_hub_checkpoint lives in checkpoint/ (file I/O) and is still importable from here
__all__ = ["is_quantized_in_hub", "quantize_fp8", "write_hub_checkpoint", "write_lora_adapter"]


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
