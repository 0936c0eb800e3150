"""Decode throughput, plain and speculative, measured after warm-up in one process.

    python scripts/bench.py                                   # the embedded default model
    python scripts/bench.py --synthetic oracle-small --k 0 1 2 3 4 --batch 1 8
    python scripts/bench.py --model DIR --k 0 3 --new-tokens 128 --json out.json

For every batch size and K (0 = plain decoding) each configuration first runs once to compile
(same shapes), then ``--repeats`` timed runs; the median decode rate is reported with the
acceptance statistics, the speed-up over K = 0 and, for K > 0, the ratio of the fused step to the
host-orchestrated baseline (same stages as separate executables with a host round trip). Ratios
are only meaningful within one run of this script.

Synthetic models: ``small`` (random weights: drafts are almost never accepted) and
``oracle-small`` (same size; its MTP layer is built to predict the target most of the time, so
the speculative machinery can be timed; its acceptance says nothing about real drafts).
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
from mtp_jax.checkpoint.synthetic import hub_tensors, oracle_draft_tensors, write_hub_checkpoint
from mtp_jax.cli import default_model_dir
from mtp_jax.config import DeepseekV3Config

# Big enough that the math, not Python overhead, dominates a CPU decode step.
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
    "num_nextn_predict_layers": 1,
    "eos_token_id": 1,
}


def timed(model, prompts, args, **kwargs) -> dict:
    model.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True, **kwargs)  # compile
    runs = [
        model.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True, **kwargs).stats
        for _ in range(args.repeats)
    ]
    rate = statistics.median(r["decode_tokens_per_second"] for r in runs)
    return {"decode_tok_s": rate, "stats": runs[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    src.add_argument("--synthetic", choices=["small", "oracle-small"], help="a generated checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--k", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="drafts per step; 0 = plain"
    )
    parser.add_argument("--draft-sampling", default="argmax", choices=["argmax", "sampled"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip the host-orchestrated baseline")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            path = os.path.join(tmp, args.synthetic)
            cfg = DeepseekV3Config.from_dict(SMALL)
            oracle = args.synthetic == "oracle-small"
            tensors = oracle_draft_tensors(cfg, 0.01) if oracle else hub_tensors(cfg)
            write_hub_checkpoint(path, SMALL, tensors)
            name = f"synthetic:{args.synthetic}"
        else:
            path = args.model or default_model_dir()
            if path is None:
                print("no --model and no embedded model found", file=sys.stderr)
                return 2
            name = os.path.basename(path.rstrip("/"))
        model = mtp_jax.load(path, dtype=args.dtype)
        rng = np.random.default_rng(0)
        rows = []
        for b in args.batch:
            prompts = rng.integers(2, model.config.vocab_size, (b, args.prompt_len)).tolist()
            base = None
            for k in args.k:
                print(f"batch {b}, K={k} ...", file=sys.stderr, flush=True)
                spec = (
                    {}
                    if k == 0
                    else {"draft": "mtp", "num_speculative_tokens": k, "draft_sampling": args.draft_sampling}
                )
                fused = timed(model, prompts, args, temperature=args.temperature, **spec)
                row = {
                    "batch": b,
                    "k": k,
                    "acceptance_length": fused["stats"]["acceptance_length"],
                    "acceptance_by_position": fused["stats"]["acceptance_rate_per_position"],
                    "decode_tok_s": fused["decode_tok_s"],
                }
                if k == 0:
                    base = fused["decode_tok_s"]
                row["speedup_vs_plain"] = fused["decode_tok_s"] / base if base else None
                if k > 0 and not args.no_baseline:
                    host = timed(model, prompts, args, temperature=args.temperature, fused=False, **spec)
                    row["host_orchestrated_tok_s"] = host["decode_tok_s"]
                    row["fused_over_host"] = fused["decode_tok_s"] / host["decode_tok_s"]
                rows.append(row)

    report = {
        "model": name,
        "dtype": args.dtype,
        "temperature": args.temperature,
        "draft_sampling": args.draft_sampling,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "results": rows,
    }
    print(
        "| batch | K | acceptance length | acceptance by position | decode tok/s | vs plain | fused / host |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        by_pos = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"]) or "-"
        ratio = f"{r['fused_over_host']:.2f}x" if "fused_over_host" in r else "-"
        print(
            f"| {r['batch']} | {r['k']} | {r['acceptance_length']:.2f} | {by_pos} | "
            f"{r['decode_tok_s']:.1f} | {r['speedup_vs_plain']:.2f}x | {ratio} |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
