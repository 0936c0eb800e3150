"""Random checkpoints in the exact hub layout, for tests, benchmarks and ``mtp-jax plan``.

Each family and draft draws its own tensors in its folder (``targets/deepseek_v3/synthetic.py``:
``hub_tensors``, MTP layers included when the config asks for them; ``targets/llama/synthetic.py``;
``drafts/eagle3/synthetic.py``; ``drafts/dflash/synthetic.py``); this module writes them the way the
hub does (``write_hub_checkpoint``: config.json plus one safetensors file, or several with a
``model.safetensors.index.json``), quantises them to block FP8 as published checkpoints are, and
writes LoRA adapters in peft's layout.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from mtp_jax.checkpoint.safetensors_io import INDEX_NAME, save_safetensors


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
