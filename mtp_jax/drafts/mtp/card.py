"""The model card of the embedded tiny DeepSeek-V3 with its MTP layer (``scripts/train_tiny.py``),
from its ``config.json`` and ``eval.json``: the MTP objective it was trained with is this draft's
(:mod:`mtp_jax.drafts.mtp.training`)."""

from __future__ import annotations

from mtp_jax.drafts.mtp.training import REACH


def _training_text(r: dict) -> str:
    """The card's account of how the weights were made: one run, or a run and a draft fine-tune."""

    def run(t: dict) -> str:
        depth = t.get("mtp_depth", 1)
        objective = f"the CE of {depth} chained MTP levels" if depth > 1 else "MTP CE"
        if t.get("mtp_labels") == "target":
            objective += " against the main model's own distribution (self-distillation)"
        if depth > 1:
            objective += f", level j weighted {REACH}^(j-1)"
        if t.get("trained") == "mtp":
            what = f"the MTP layer alone (main model frozen), loss = {objective}"
            if t.get("own_text"):
                what += (
                    f"; {t['own_text']:.0%} of each batch from {t['own_text_windows']:,} windows of the main "
                    "model's own greedy continuations of training-text prompts (on-policy data)"
                )
        else:
            what = f"loss = next-token CE + {t['mtp_weight']} x {objective}"
        return (
            f"{t['steps']} steps of {t['batch']} x {t['seq']} tokens ({t['tokens_seen']:,} tokens), AdamW "
            f"(lr {t['lr']}, warm-up {t['warmup']}, cosine decay), {what}, auxiliary-loss-free expert "
            f"balancing (bias rate {t['bias_rate']}), seed {t['seed']}; {t['seconds'] / 60:.1f} minutes on "
            f"{t['machine']}."
        )

    t = r["training"]
    if "base" not in r:
        return run(t)
    labels = (
        "The labels are the main model's own next-token distributions at those positions rather than the "
        "text's tokens: the draft learns the choices it is accepted on. "
        if t.get("mtp_labels") == "target"
        else ""
    )
    return (
        f"Two runs of `scripts/train_tiny.py`. First, from random weights: {run(r['base']['training'])}\n\n"
        f"Then, from those weights (`--init-from`, `--train mtp`): {run(t)} Level 1 is the MTP layer "
        "as DeepSeek-V3 trains it (t+2 from the main model's hidden state); level j > 1 feeds the layer "
        "its own output state and predicts t+j+1, with the attention pattern of the decode-time chain, "
        f"so the layer learns the chained draft positions it is used for. {labels}The main model's "
        "weights are the first run's, bit for bit."
    )


def _levels_row(h: dict) -> str:
    if "level_agreement" not in h:
        return ""
    values = " / ".join(f"{a:.3f}" for a in h["level_agreement"])
    names = " / ".join(str(j + 1) for j in range(len(h["level_agreement"])))
    return f"| teacher-forced agreement of chained levels {names} (true earlier tokens) | {values} |\n"


def tiny_card(config: dict, r: dict) -> str:
    """The model card (README.md) of a tiny DeepSeek-V3 with MTP from its ``config.json`` and its
    ``eval.json`` report ``r``."""
    d, h, c = r["data"], r["heldout"], config
    shape = f"{c['hidden_size']} / {c['num_hidden_layers']} (+1 MTP) / {c['num_attention_heads']}"
    experts = (
        f"{c['n_routed_experts']} routed (top {c['num_experts_per_tok']}, {c['n_group']} groups, "
        f"top {c['topk_group']}) + {c['n_shared_experts']} shared"
    )
    acc = r.get("acceptance")
    before = r.get("base", {}).get("acceptance")
    acc_head = "| K | acceptance length |\n|---|---|"
    if acc and before:
        acc_head = "| K | acceptance length | before the draft fine-tune |\n|---|---|---|"
        acc_lines = "\n".join(
            f"| {k} | {v:.2f} | {f'{before[k]:.2f}' if k in before else '-'} |" for k, v in acc.items()
        )
    elif acc:
        acc_lines = "\n".join(f"| {k} | {v:.2f} |" for k, v in acc.items())
    else:
        acc_lines = "| - | measured by `mtp-jax bench` (see BENCHMARKS.md) |"
    return f"""# Tiny DeepSeek-V3 with MTP, trained on the Python standard library

The embedded default model of mtp-jax, written by `scripts/train_tiny.py`. It is a real
DeepSeek-V3-architecture model — MLA attention with q/kv low-rank projections, one dense layer then
mixture-of-experts layers with group-limited sigmoid routing and a shared expert, and one MTP
(NextN) layer stored as layer {config["num_hidden_layers"]} — at {r["parameters"] / 1e6:.2f}M
parameters, so that speculative decoding can be shown and measured on any machine. It writes
Python-looking code; it knows nothing else.

| | |
|---|---|
| hidden / layers / heads | {shape} |
| experts | {experts} |
| vocabulary | {config["vocab_size"]} byte-level BPE tokens (`tokenizer.json`) |
| weights | bfloat16 safetensors, Hugging Face DeepSeek-V3 layout |

## Data
{d["source"]}, Python {d["python"]}: {d["train_modules"]} modules for training
({d["train_tokens"]:,} tokens) and {d["heldout_modules"]} held out by a hash of the module path
({d["heldout_tokens"]:,} tokens; listed in `eval.json`). The standard library is under the PSF license.

## Training
{_training_text(r)}

## Held-out results
| | |
|---|---|
| next-token loss / perplexity | {h["loss"]:.3f} / {h["perplexity"]:.2f} |
| MTP loss (t+2, against the text) | {h["mtp_loss"]:.3f} |
| teacher-forced MTP agreement with the target's greedy token | {h["mtp_agreement"]:.3f} |
| perplexity of the test snippet (`eval.json`) | {r["snippet"]["perplexity"]:.2f} |
{_levels_row(h)}
Acceptance length (tokens per step, greedy, MTP drafts) on the held-out prompts in `eval.json`:

{acc_head}
{acc_lines}

Decode speed, plain against speculative, is in the repository's BENCHMARKS.md (`mtp-jax bench`).
"""
