"""Write the Llama-family parity fixtures (Llama 3, Qwen2, Qwen3): tiny random hub-layout
checkpoints plus what transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` computes on them.

    pip install -e .[parity]        # torch (CPU) + transformers>=5
    python scripts/make_llama_parity_fixtures.py --out tests/fixtures/parity_llama [--only NAME ...]

Each fixture directory holds ``config.json`` as the hub writes it, the weights (one safetensors
file, or shards plus ``model.safetensors.index.json``) written by our own writer, and
``reference.npz`` computed by ``transformers.AutoModelForCausalLM.from_pretrained`` on that directory
(float32, eager attention, one CPU thread), so the layout is proven to be the one transformers
reads:

- ``input_ids`` int32 [B, T]; ``logits`` float32 [B, T, V] (teacher-forced);
- ``hidden_states`` float32 [L+1, B, T, H]: transformers' output_hidden_states (entry 0 the
  embedding, entry i+1 the output of layer i, except the LAST entry, which is after the final norm);
- ``greedy`` int32 [B, P + N]: ``generate(input_ids[:, :P], max_new_tokens=N, do_sample=False)``
  with ``prompt_length`` P and ``new_tokens`` N stored beside it.

BF16 / FP16 fixtures are run on their exact float32 upcast. Deterministic (same bytes every run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint  # noqa: E402
from mtp_jax.config import parse_config  # noqa: E402
from mtp_jax.targets.llama.synthetic import llama_hub_tensors  # noqa: E402

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

# head_dim 8 at theta 10000 has wavelengths 6.3, 63, 628, 6283: with original 64 positions,
# low_freq_factor 1 and high_freq_factor 4 (bands at 64 and 16) one frequency is kept, one is
# blended and two are divided by the factor, so every branch of the llama3 formula is exercised.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

FIXTURES = {
    "llama3_gqa42": (
        "GQA 4/2, head_dim 8, llama3 rope scaling (original 64: kept, blended and scaled "
        "frequencies), untied",
        {"rope_scaling": LLAMA3_SCALING},
        {"dtype": "float32", "shards": 1, "T": 40},
    ),
    "gqa81_tied_head_dim": (
        "GQA 8/1, explicit head_dim 12 (hidden 32 / 8 heads would be 4), tied embeddings (no lm_head "
        "tensor, as Llama 3.2 1B/3B), no rope scaling, rms_norm_eps 1e-6, rope_theta 500000",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 12,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0,
        },
        # a small tied embedding: with a unit one the head would favour repeating the input token
        {"dtype": "float32", "shards": 1, "T": 24, "embed_std": 0.05, "std": 0.5},
    ),
    "sharded_bf16_rope_parameters": (
        "BF16 weights in 3 shards + index; rope given the transformers >= 5 way (rope_parameters with "
        "rope_theta and llama3 scaling, no top-level rope_theta/rope_scaling); GQA 4/1, 4 layers",
        {
            "num_key_value_heads": 1,
            "num_hidden_layers": 4,
            "rope_parameters": {"rope_theta": 10000.0, **LLAMA3_SCALING},
            "torch_dtype": "bfloat16",
        },
        {"dtype": "bfloat16", "shards": 3, "T": 32, "drop": ("rope_theta",)},
    ),
    "qwen2_bias_tied": (
        "Qwen2 (model_type qwen2): q/k/v biases, tied embeddings (as Qwen2.5 0.5B-3B), rope_theta "
        "1e6, a published-style sliding_window that use_sliding_window false leaves unused; GQA 4/2",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "tie_word_embeddings": True,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "use_sliding_window": False,
            "sliding_window": 4096,
            "max_window_layers": 3,
            "drop_llama": ("attention_bias", "mlp_bias", "pretraining_tp"),
        },
        {"dtype": "float32", "shards": 1, "T": 32, "embed_std": 0.05, "std": 0.5},
    ),
    "qwen3_qk_norm": (
        "Qwen3 (model_type qwen3): RMSNorm on each query and key head before rope, explicit head_dim "
        "16 (hidden 32 / 4 heads would be 8), no biases, untied, BF16 weights; GQA 4/2",
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "head_dim": 16,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 3,
            "torch_dtype": "bfloat16",
            "drop_llama": ("mlp_bias", "pretraining_tp"),
        },
        {"dtype": "bfloat16", "shards": 1, "T": 32},
    ),
    "mha_fp16": (
        "MHA (8/8 heads, head_dim 4), FP16 weights, no rope scaling, untied, eos a list",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "torch_dtype": "float16",
            "eos_token_id": [2, 3],
        },
        {"dtype": "float16", "shards": 1, "T": 20},
    ),
}

PROMPT, NEW = 8, 16


def build(name: str, out: str) -> None:
    import ml_dtypes

    doc, overrides, opts = FIXTURES[name]
    config = {**BASE, **overrides}
    for key in (*opts.get("drop", ()), *config.pop("drop_llama", ())):
        config.pop(key)
    cfg = parse_config(config)
    std, embed_std = opts.get("std", 0.15), opts.get("embed_std", 1.0)
    tensors = llama_hub_tensors(cfg, seed=sum(map(ord, name)), std=std, embed_std=embed_std)
    stored = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[opts["dtype"]]
    tensors = {k: v.astype(stored) for k, v in tensors.items()}
    directory = os.path.join(out, name)
    shutil.rmtree(directory, ignore_errors=True)
    write_hub_checkpoint(directory, config, tensors, shards=opts["shards"])
    write_reference(directory, name, cfg.vocab_size, opts["T"])
    print(f"{name}: {doc}", file=sys.stderr)


def write_reference(directory: str, name: str, vocab_size: int, length: int) -> None:
    """``reference.npz`` of the checkpoint in ``directory`` (the module docstring's arrays), from
    transformers' ``AutoModelForCausalLM`` on it: two rows of ``length`` seeded random tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None  # never stop early: N tokens, nothing masked
    rng = np.random.default_rng(len(name))
    input_ids = rng.integers(3, vocab_size, (2, length)).astype(np.int32)
    with torch.no_grad():
        res = model(torch.as_tensor(input_ids, dtype=torch.long), output_hidden_states=True)
        greedy = model.generate(
            torch.as_tensor(input_ids[:, :PROMPT], dtype=torch.long),
            attention_mask=torch.ones((2, PROMPT), dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    np.savez_compressed(
        os.path.join(directory, "reference.npz"),
        input_ids=input_ids,
        logits=res.logits.numpy().astype(np.float32),
        hidden_states=np.stack([h.numpy() for h in res.hidden_states]).astype(np.float32),
        greedy=greedy.numpy().astype(np.int32),
        prompt_length=np.int32(PROMPT),
        new_tokens=np.int32(NEW),
    )


def write_readme(out: str, title: str, what: str, script: str, fixtures: dict) -> None:
    """``out/README.md``: how the fixtures ``fixtures`` (name -> (doc, ...)) of ``what`` checkpoints
    were made and what ``reference.npz`` holds."""
    import torch
    import transformers

    lines = [
        f"# transformers parity fixtures ({title})",
        "",
        f"Tiny random {what} checkpoints in the exact hub layout plus `reference.npz` computed by",
        "`transformers.AutoModelForCausalLM.from_pretrained` on each directory (float32, eager attention,",
        "one CPU thread; BF16/FP16 weights upcast exactly). Do not edit; regenerate with:",
        "",
        "    pip install -e .[parity]",
        f"    python scripts/{script}",
        "",
        f"Generated with transformers {transformers.__version__}, torch {torch.__version__}, "
        f"numpy {np.__version__}.",
        "",
        "| fixture | what it exercises |",
        "|---|---|",
        *(f"| `{name}` | {entry[0]} |" for name, entry in fixtures.items()),
        "",
        "`reference.npz`: `input_ids` int32 [B,T]; `logits` float32 [B,T,V]; `hidden_states` float32",
        "[L+1,B,T,H] (entry 0 the embedding, i+1 the output of layer i, the last one after the final norm);",
        f"`greedy` int32 [B,{PROMPT}+{NEW}]: `generate(input_ids[:, :{PROMPT}], max_new_tokens={NEW}, "
        "do_sample=False)`; `prompt_length`, `new_tokens`.",
        "",
    ]
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "parity_llama"))
    parser.add_argument("--only", nargs="+", choices=sorted(FIXTURES))
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    for name in args.only or FIXTURES:
        build(name, args.out)
    write_readme(args.out, "Llama 3, Qwen2, Qwen3", "Llama-family", "make_llama_parity_fixtures.py", FIXTURES)
    print(json.dumps({"written": list(args.only or FIXTURES), "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
