"""Write the Gemma 3 parity fixtures: tiny random ``Gemma3ForCausalLM`` checkpoints in the exact
hub layout plus what transformers computes on them.

    pip install -e .[parity]        # torch (CPU) + transformers>=5
    python scripts/make_gemma3_parity_fixtures.py --out tests/fixtures/parity_gemma3 [--only NAME ...]

Each directory holds ``config.json`` as transformers writes a Gemma 3 text config, the weights
written by our own writer, and ``reference.npz`` computed by
``transformers.AutoModelForCausalLM.from_pretrained`` on that directory (float32, eager attention,
one CPU thread; the arrays of :mod:`make_llama_parity_fixtures`). The sliding windows are a few
tokens wide so that the 24-token rows and the greedy continuation (8 prompt tokens, 16 new) cross
them. Deterministic (same bytes every run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from make_llama_parity_fixtures import write_readme, write_reference  # noqa: E402

from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint  # noqa: E402
from mtp_jax.config import parse_config  # noqa: E402
from mtp_jax.targets.gemma3.synthetic import gemma3_hub_tensors  # noqa: E402

BASE = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "float32",
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
}

LOCAL, GLOBAL = "sliding_attention", "full_attention"

FIXTURES = {
    "pattern6_tied": (
        "the published pattern (layers 5 and 11 global of 12: layer_types written out), window 4, "
        "query_pre_attn_scalar 24 (not head_dim), rope bases 1e6 / 1e4 in rope_parameters, GQA 4/1, tied",
        {
            "num_hidden_layers": 12,
            "sliding_window": 4,
            "query_pre_attn_scalar": 24,
            "layer_types": [GLOBAL if (i + 1) % 6 == 0 else LOCAL for i in range(12)],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        {"dtype": "float32"},
    ),
    "mixed_softcap_linear_untied": (
        "layers local, global, local (the pattern as layer_types), window 3, final logits soft-capped at 3, "
        "linear rope scaling x8 on the global layer (rope_scaling with rope_theta / rope_local_base_freq), "
        "GQA 4/2, untied head, BF16 weights",
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "sliding_window": 3,
            "query_pre_attn_scalar": 16,
            "layer_types": [LOCAL, GLOBAL, LOCAL],
            "final_logit_softcapping": 3.0,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "tie_word_embeddings": False,
        },
        {"dtype": "bfloat16"},
    ),
    "all_global_pattern1": (
        "every layer global (the older sliding_window_pattern 1 spelling, no layer_types), MHA 4/4, "
        "a window of 2 that no layer uses",
        {
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "sliding_window": 2,
            "query_pre_attn_scalar": 16,
            "sliding_window_pattern": 1,
        },
        {"dtype": "float32"},
    ),
}
LENGTH = 24


def build(name: str, out: str) -> None:
    import ml_dtypes

    doc, overrides, opts = FIXTURES[name]
    config = {**BASE, **overrides}
    cfg = parse_config(config)
    tensors = gemma3_hub_tensors(cfg, seed=sum(map(ord, name)), std=0.15)
    stored = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[opts["dtype"]]
    tensors = {k: v.astype(stored) for k, v in tensors.items()}
    directory = os.path.join(out, name)
    shutil.rmtree(directory, ignore_errors=True)
    write_hub_checkpoint(directory, config, tensors)
    write_reference(directory, name, cfg.vocab_size, LENGTH)
    print(f"{name}: {doc}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "parity_gemma3"))
    parser.add_argument("--only", nargs="+", choices=sorted(FIXTURES))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or FIXTURES:
        build(name, args.out)
    write_readme(args.out, "Gemma 3 text", "`Gemma3ForCausalLM`", "make_gemma3_parity_fixtures.py", FIXTURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
