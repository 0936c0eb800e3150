"""Decode throughput of plain (non-speculative) decoding, measured after warm-up.

    python scripts/bench.py                       # the embedded default model, batch 1 and 8
    python scripts/bench.py --synthetic small     # a larger random config written to a temp dir
    python scripts/bench.py --model DIR --batch 1 4 16 --new-tokens 128 --json out.json

Each configuration runs once to compile (same shapes), then ``--repeats`` timed runs; the best
and median decode tokens/s are reported. Only ratios measured in one run should be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

import jax
import numpy as np

import mtp_jax
from mtp_jax.checkpoint.synthetic import hub_tensors, write_hub_checkpoint
from mtp_jax.cli import default_model_dir
from mtp_jax.config import DeepseekV3Config

# A "small" config: big enough that the math, not Python overhead, dominates a CPU decode step.
SMALL = {
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "eos_token_id": 1,
}


def bench_one(model: mtp_jax.Model, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, model.config.vocab_size, (batch, prompt_len)).tolist()
    model.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)  # compile these shapes
    runs = [model.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True).stats for _ in range(repeats)]
    rates = [r["decode_tokens_per_second"] for r in runs]
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "decode_tok_s_best": max(rates),
        "decode_tok_s_median": statistics.median(rates),
        "step_ms_median": 1000.0
        * statistics.median(r["decode_seconds"] / max(r["decode_steps"], 1) for r in runs),
        "prefill_ms_median": 1000.0 * statistics.median(r["prefill_seconds"] for r in runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    src.add_argument("--synthetic", choices=["small"], help="benchmark a random checkpoint of this config")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            path = os.path.join(tmp, args.synthetic)
            write_hub_checkpoint(path, SMALL, hub_tensors(DeepseekV3Config.from_dict(SMALL), seed=0))
            name = f"synthetic:{args.synthetic}"
        else:
            path = args.model or default_model_dir()
            if path is None:
                print("no --model and no embedded model found", file=sys.stderr)
                return 2
            name = path
        model = mtp_jax.load(path, dtype=args.dtype)
        results = []
        for b in args.batch:
            print(f"batch {b} ...", file=sys.stderr, flush=True)
            results.append(bench_one(model, b, args.prompt_len, args.new_tokens, args.repeats))

    report = {
        "model": name,
        "dtype": args.dtype,
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "results": results,
    }
    print("| model | dtype | batch | prompt | new | decode tok/s (median) | best | step ms | prefill ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {name} | {args.dtype} | {r['batch']} | {r['prompt_len']} | {r['new_tokens']} | "
            f"{r['decode_tok_s_median']:.1f} | {r['decode_tok_s_best']:.1f} | {r['step_ms_median']:.2f} | "
            f"{r['prefill_ms_median']:.1f} |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
