"""Write the placeholder default model: a tiny, randomly initialised DeepSeek-V3 in hub layout.

It exists so the README's first command has a model to run on a fresh machine; its weights are
random, so its text is noise and drafts will rarely be accepted. The trained default replaces it
(see the embedded-default issue). Deterministic given --seed:

    python scripts/make_tiny_checkpoint.py --out checkpoints/tiny-random-deepseek-v3

The byte-level BPE tokenizer is trained with the ``tokenizers`` package on a few modules of the
Python standard library, which every machine has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtp_jax.checkpoint.synthetic import hub_tensors, write_hub_checkpoint
from mtp_jax.config import DeepseekV3Config

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]
MODULES = ["argparse.py", "collections/__init__.py", "functools.py", "json/decoder.py", "textwrap.py"]

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 512,
    },
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, m) for m in MODULES]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    return tok


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="checkpoints/tiny-random-deepseek-v3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = DeepseekV3Config.from_dict(CONFIG)
    tok = train_tokenizer(cfg.vocab_size)
    if tok.get_vocab_size() != cfg.vocab_size:
        print(f"tokenizer has {tok.get_vocab_size()} tokens, expected {cfg.vocab_size}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = os.path.join(tmp, "tokenizer.json")
        tok.save(tok_path)
        gen_path = os.path.join(tmp, "generation_config.json")
        with open(gen_path, "w", encoding="utf-8") as f:
            json.dump({"bos_token_id": 0, "eos_token_id": 1}, f, indent=2)
        write_hub_checkpoint(
            args.out,
            CONFIG,
            hub_tensors(cfg, seed=args.seed),
            extra_files={"tokenizer.json": tok_path, "generation_config.json": gen_path},
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
