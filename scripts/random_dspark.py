"""Write a DSpark draft with random weights for a target, in DeepSpec's layout: for timing the
DSpark step and measuring its SPS table before a trained draft exists (its acceptance means
nothing).

    python scripts/random_dspark.py --target smollm2-135m-instruct --out /tmp/dspark-smollm2
    mtp-jax bench --model smollm2-135m-instruct --draft-model /tmp/dspark-smollm2 --k 7 \\
        --batch 1 8 32 --sps-table sps.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target model (name or directory)")
    p.add_argument("--out", required=True, help="a new directory")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--rank", type=int, default=256, help="the Markov head's rank (0: none)")
    p.add_argument("--head", choices=["vanilla", "gated", "rnn"], default="vanilla")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import numpy as np

    import mtp_jax
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors

    target = mtp_jax.load(args.target, "float32")
    cfg = target.config  # a Llama-family or DeepSeek-V3 target's parsed config (any checkpoint format)
    n = cfg.num_hidden_layers
    ids = sorted({1, n // 2, n - 2})  # early, middle and late layers (the final one is not allowed)
    heads = cfg.num_attention_heads
    draft = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", heads),
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": getattr(cfg, "rope_theta", 10000.0),
        "max_position_embeddings": cfg.max_position_embeddings,
        "block_size": args.block_size,
        "num_target_layers": n,
        "target_layer_ids": ids,
        "mask_token_id": cfg.vocab_size - 1,
        "markov_rank": args.rank,
        "markov_head_type": args.head,
        "enable_confidence_head": True,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * args.layers,
    }
    embed = np.asarray(target.params["embed"], np.float32)
    head = np.asarray(target.params["lm_head"], np.float32).T if "lm_head" in target.params else embed
    tensors = dspark_hub_tensors(DSparkConfig.from_dict(draft), embed, head, args.seed, 0.02, 0.1)
    write_hub_checkpoint(args.out, draft, tensors)
    shape = f"{args.layers} layers, block {args.block_size}, {args.head} rank {args.rank}"
    print(f"random DSpark draft ({shape}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
