"""Conversion throughput and peak host memory on a generated multi-GB checkpoint.

    python scripts/bench_convert.py [--dir /tmp/mtp-bench] [--weights bf16|fp8] [--keep]

Writes a random DeepSeek-V3-architecture checkpoint of about 3.7 GB (bf16, one safetensors shard
per layer with an index, as on the hub) or about 2 GB (FP8 with 128x128 block scales), then in
separate child processes (so each peak RSS is its own) runs ``mtp-jax convert`` and a direct
``mtp_jax.load``, reporting MB/s and peak resident memory beside the largest layer group.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from mtp_jax.checkpoint.safetensors_io import INDEX_NAME, CheckpointReader, save_safetensors
from mtp_jax.synthetic import quantize_fp8
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.synthetic import layer_tensors

CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "q_lora_rank": 512,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 32,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "eos_token_id": 1,
}
FP8_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def write_checkpoint(path: str, weights: str) -> int:
    """One shard per layer (plus one for embeddings/head), streamed: memory stays at one layer."""
    config = dict(CONFIG, quantization_config=FP8_QUANT) if weights == "fp8" else dict(CONFIG)
    cfg = DeepseekV3Config.from_dict(config)
    rng = np.random.default_rng(0)
    os.makedirs(path)
    weight_map, total = {}, 0
    n_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for i in range(-1, n_layers):
        if i < 0:
            d, v = cfg.hidden_size, cfg.vocab_size
            tensors = {
                "model.embed_tokens.weight": rng.standard_normal((v, d), np.float32),
                "model.norm.weight": np.ones(d, np.float32),
                "lm_head.weight": rng.standard_normal((v, d), np.float32) * 0.02,
            }
        else:
            tensors = layer_tensors(cfg, i, rng, 0.02)
            if i >= cfg.num_hidden_layers:  # the MTP layer's extra tensors
                d = cfg.hidden_size
                pre = f"model.layers.{i}."
                tensors.update(
                    {
                        f"{pre}enorm.weight": np.ones(d, np.float32),
                        f"{pre}hnorm.weight": np.ones(d, np.float32),
                        f"{pre}eh_proj.weight": rng.standard_normal((d, 2 * d), np.float32) * 0.02,
                        f"{pre}shared_head.norm.weight": np.ones(d, np.float32),
                    }
                )
        if weights == "fp8":
            tensors = quantize_fp8(tensors, (128, 128))
        stored = {
            k: (
                x
                if x.dtype == ml_dtypes.float8_e4m3fn or k.endswith(("_scale_inv", "correction_bias"))
                else x.astype(ml_dtypes.bfloat16)
            )
            for k, x in tensors.items()
        }
        name = f"model-{i + 2:05d}-of-{n_layers + 1:05d}.safetensors"
        total += save_safetensors(os.path.join(path, name), stored)
        weight_map.update({k: name for k in stored})
        print(f"  wrote {name}", file=sys.stderr, flush=True)
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total


def run_child(code: str) -> tuple[float, int]:
    """Run ``code`` in a fresh interpreter: (seconds, the child's own peak RSS in bytes).

    Read from VmHWM in /proc: unlike getrusage's ru_maxrss, which survives execve and would report
    the parent's peak (this script's generation phase), it belongs to the new address space."""
    code += "\nprint([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].strip())"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE, text=True).stdout
    seconds = time.perf_counter() - t0
    peak_kb = int(next(line for line in out.splitlines() if line.startswith("VmHWM")).split()[1])
    return seconds, peak_kb * 1024


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="/tmp/mtp-bench-convert")
    parser.add_argument("--weights", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()
    src, dst = os.path.join(args.dir, f"src-{args.weights}"), os.path.join(args.dir, f"dst-{args.weights}")
    if not os.path.isdir(src):
        print(f"generating {src} ...", file=sys.stderr)
        write_checkpoint(src, args.weights)
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    cfg = DeepseekV3Config.from_json_file(os.path.join(src, "config.json"))
    reader = CheckpointReader(src)
    prefix = f"model.layers.{cfg.first_k_dense_replace}."
    group = sum(
        int(np.prod(reader.shape(k))) * reader.dtype(k).itemsize
        for k in reader.keys()
        if k.startswith(prefix)
    )
    print(f"source: {size / 1e9:.2f} GB; largest group (one MoE layer, as stored): {group / 1e9:.3f} GB")
    results = {"source_gb": size / 1e9, "largest_group_gb": group / 1e9}
    _, base = run_child("import jax, orbax.checkpoint, mtp_jax; jax.numpy.zeros(1).block_until_ready()")
    results["baseline_rss_gb"] = base / 1e9
    print(f"baseline process (python + jax + orbax imported): peak RSS {base / 1e9:.2f} GB")
    shutil.rmtree(dst, ignore_errors=True)
    code = (
        f"from mtp_jax.checkpoint.convert import convert; convert({src!r}, {dst!r}, weights={args.weights!r})"
    )
    seconds, peak = run_child(code)
    results.update(convert_seconds=seconds, convert_mb_s=size / 1e6 / seconds, convert_peak_rss_gb=peak / 1e9)
    print(f"convert: {seconds:.1f}s, {size / 1e6 / seconds:.0f} MB/s, peak RSS {peak / 1e9:.2f} GB")
    weights = "fp8" if args.weights == "fp8" else "dense"
    code = f"import mtp_jax; mtp_jax.load({src!r}, 'bfloat16', weights={weights!r})"
    seconds, peak = run_child(code)
    results.update(load_seconds=seconds, load_peak_rss_gb=peak / 1e9)
    print(
        f"direct load (hub): {seconds:.1f}s, peak RSS {peak / 1e9:.2f} GB "
        f"(the CPU backend's device memory is host memory: the loaded model itself counts)"
    )
    code = f"import mtp_jax; mtp_jax.load({dst!r}, 'bfloat16', weights={weights!r})"
    seconds, peak = run_child(code)
    results.update(load_converted_seconds=seconds, load_converted_peak_rss_gb=peak / 1e9)
    print(f"load converted (orbax): {seconds:.1f}s, peak RSS {peak / 1e9:.2f} GB")
    print(json.dumps(results))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
