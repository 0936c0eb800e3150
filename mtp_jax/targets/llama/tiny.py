"""The embedded tiny Llama 3 and its draft model (``scripts/train_tiny.py --arch llama``): the
architecture at sizes that train on two CPU cores, its initial weights and its model card."""

from __future__ import annotations

import numpy as np

from mtp_jax.targets.base import initial_hub_tensors
from mtp_jax.targets.llama.config import Llama3Config
from mtp_jax.targets.llama.synthetic import llama_hub_tensors

# hidden, layers, MLP width, heads, KV heads
PRESETS = {"default": (192, 6, 512, 6, 2), "smoke": (32, 2, 64, 4, 2), "draft": (64, 2, 192, 4, 2)}


def tiny_config(vocab_size: int, preset: str, bos: int, eos: int) -> dict:
    """A Llama 3.1-style ``config.json`` (GQA 3:1, llama3 rope scaling, untied head); ``preset``
    "draft" is the 2-layer, 64-wide draft model."""
    d, layers, ffn, heads, kv_heads = PRESETS[preset]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": d,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        # Llama 3.1's frequency scaling, with the original context at this model's training window
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def tiny_tensors(cfg: Llama3Config, seed: int) -> dict[str, np.ndarray]:
    """Initial hub-layout weights (:func:`mtp_jax.targets.base.initial_hub_tensors`)."""
    shapes = {name: w.shape for name, w in llama_hub_tensors(cfg, seed=0).items()}
    return initial_hub_tensors(shapes, seed, cfg.num_hidden_layers)


def tiny_card(config: dict, r: dict) -> str:
    """The model card (README.md) of a tiny Llama written by ``scripts/train_tiny.py --arch llama``
    from its ``config.json`` and ``eval.json`` report ``r``."""
    d, h, c, t = r["data"], r["heldout"], config, r["training"]
    rs = c["rope_scaling"]
    shape = " / ".join(
        str(x)
        for x in (
            c["hidden_size"],
            c["num_hidden_layers"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["hidden_size"] // c["num_attention_heads"],
        )
    )
    rope = (
        f"theta {c['rope_theta']:g}, llama3 scaling x{rs['factor']:g} (original "
        f"{rs['original_max_position_embeddings']} positions, low/high frequency factors "
        f"{rs['low_freq_factor']:g}/{rs['high_freq_factor']:g})"
    )
    title, what, role, command, tokenizer = _card_identity(t)
    return f"""# {title} trained on the Python standard library

{what}. A real
`LlamaForCausalLM` — grouped-query attention, rotate-half rope with Llama 3.1's `llama3`
frequency scaling, RMSNorm, SwiGLU, an untied output head — at {r["parameters"] / 1e6:.2f}M
parameters, trained on the same text, split and tokenizer as the embedded tiny DeepSeek-V3. {role}

| | |
|---|---|
| hidden / layers / heads / KV heads / head_dim | {shape} |
| MLP | SwiGLU, intermediate {c["intermediate_size"]} |
| rope | {rope} |
| vocabulary | {c["vocab_size"]} tokens: {tokenizer} |
| weights | bfloat16 safetensors, Hugging Face Llama layout |

## Data
{d["source"]}, Python {d["python"]}: {d["train_modules"]} modules for training
({d["train_tokens"]:,} tokens) and {d["heldout_modules"]} held out by a hash of the module path
({d["heldout_tokens"]:,} tokens; listed in `eval.json`). The standard library is under the PSF license.

## Training
{t["steps"]} steps of {t["batch"]} x {t["seq"]} tokens ({t["tokens_seen"]:,} tokens), AdamW (lr {t["lr"]},
warm-up {t["warmup"]}, cosine decay), next-token cross-entropy, seed {t["seed"]};
{t["seconds"] / 60:.1f} minutes on {t["machine"]}. The command (resumable: rerun it after an
interruption):

    {command}

## Held-out results
| | |
|---|---|
| next-token loss / perplexity | {h["loss"]:.3f} / {h["perplexity"]:.2f} |
| perplexity of the test snippet (`eval.json`) | {r["snippet"]["perplexity"]:.2f} |

Plain decoding speed is in the repository's BENCHMARKS.md.
"""


def _card_identity(t: dict) -> tuple[str, str, str, str, str]:
    """The card's title, origin, role, training command and tokenizer line for a target or, with
    ``--preset draft``, the draft model."""
    draft = t.get("preset") == "draft"
    command = (
        "python scripts/train_tiny.py --arch llama "
        + (
            "--preset draft --out checkpoints/tiny-llama3-stdlib-draft "
            if draft
            else "--out checkpoints/tiny-llama3-stdlib "
        )
        + f"--steps {t['steps']} --batch {t['batch']} --seq {t['seq']} --lr {t['lr']} "
        f"--warmup {t['warmup']} --seed {t['seed']}"
        + (f" --tokenizer-from checkpoints/{t['tokenizer_from']}" if t.get("tokenizer_from") else "")
    )
    tokenizer = (
        f"the tokenizer of `{t['tokenizer_from']}` (`tokenizer.json`, copied)"
        if t.get("tokenizer_from")
        else "a byte-level BPE trained on the training split (`tokenizer.json`)"
    )
    if draft:
        title, what = (
            "Tiny Llama 3 draft model",
            (
                "A separate draft model for mtp-jax's embedded targets, written by\n"
                "`scripts/train_tiny.py --arch llama --preset draft`"
            ),
        )
        role = """It drafts
for both embedded targets, which share its tokenizer (`draft="draft_model"`):
`mtp_jax.load("checkpoints/tiny-llama3-stdlib", draft_model="checkpoints/tiny-llama3-stdlib-draft")`,
or `--draft-model` on the command line. Its acceptance and speed against the EAGLE-3 drafts and
the MTP layer are in the repository's BENCHMARKS.md ("a separate draft model")."""
    else:
        title, what = (
            "Tiny Llama 3",
            "The embedded Llama 3 target of mtp-jax, written by `scripts/train_tiny.py --arch llama`",
        )
        role = """It is
the target the EAGLE-3 and DFlash drafts are trained against. It writes Python-looking code; it
knows nothing else. It has no draft of its own: `mtp-jax generate` decodes it plainly."""
    return title, what, role, command, tokenizer
