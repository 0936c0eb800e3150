"""Train an EAGLE-3 draft against a frozen target (the embedded tiny Llama 3 or DeepSeek-V3) on the
Python standard library, and write it in the published hub layout.

    python scripts/train_eagle3.py --target checkpoints/tiny-llama3-stdlib \\
        --out checkpoints/tiny-llama3-stdlib-eagle3                                  # GQA draft
    python scripts/train_eagle3.py --target checkpoints/tiny-deepseek-v3-stdlib \\
        --out checkpoints/tiny-deepseek-v3-stdlib-eagle3                             # MLA draft
    python scripts/train_eagle3.py --target DIR --out /tmp/smoke --preset smoke      # seconds

The draft (docs/formats.md, "EAGLE-3 drafts"; :mod:`mtp_jax.drafts.eagle3.draft`) is one decoder layer over
the concatenated residual streams of three target layers (``--layer-ids``, read as layer INPUTS as
vLLM reads ``eagle_aux_hidden_state_layer_ids``) fused by ``fc``, and the embedding of the next
token. Its attention is the target's kind: Llama-style GQA for a Llama target, DeepSeek's MLA
(SGLang's ``Eagle3DeepseekV2ForCausalLM`` layout) for a DeepSeek-V3 target (``--attention``). It
uses the target's embedding (not stored); its head covers a draft vocabulary of the ``--draft-vocab``
most frequent tokens of the training data (``d2t`` offsets and the ``t2d`` mask), initialised
from the target's head rows.

Recipe (EAGLE-3, "training-time test"): the draft is unrolled ``--depth`` steps over whole
windows exactly as speculative decoding chains it: step 1 reads the target's features with the
next token; step j > 1 reads step j-1's own recycled state with the next true token, its attention
seeing what the decode-time cache holds (step-1 rows before it and its own chain;
:func:`mtp_jax.drafts.eagle3.draft.eagle3_chain_teacher_forced`). Each step's labels are the target's
own next-token distribution restricted to the draft vocabulary (soft cross-entropy:
self-distillation, what acceptance measures); step j is weighted ``--step-decay``^(j-1)
(normalised). ``--own-text F`` takes a fraction F of each batch from the target's own greedy
continuations of training-text prompts (generated once, kept beside the training state): at
temperature 0 a draft is scored on the target's text, not the library's. The target is frozen:
its features and labels are recomputed every step from its shipped weights, or read from a target
cache built once (``--target-cache DIR``, :mod:`mtp_jax.train.target_cache`: features and the top
``--cache-k`` teacher tokens per training token).

AdamW with warm-up and cosine decay, clipping at 1.0, deterministic given ``--seed`` (batches are
drawn from (seed, step), so a resumed run sees the same ones). The training state is saved with
orbax to ``--workdir`` every ``--save-every`` steps; rerunning the same command resumes. At the end
the draft is written as bf16 safetensors in the ``layers.0.*`` dialect with a ``config.json``
carrying ``eagle_config.eagle_aux_hidden_state_layer_ids``, ``eval.json`` (held-out per-step
agreement, greedy acceptance lengths of speculative decoding with the target) and a model card,
atomically.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.config import ModelConfig
from mtp_jax.drafts.eagle3.checkpoint import load_eagle3
from mtp_jax.drafts.eagle3.draft import fused_features
from mtp_jax.drafts.eagle3.export import eagle3_hub_tensors_from_params
from mtp_jax.drafts.eagle3.training import (
    LAYER_PREFIX,
    draft_config,
    draft_losses,
    evaluate,
    init_draft,
    spread_layer_ids,
)
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.train.cards import acceptance_setup, data_sentence, own_text_clause, rewrite_card, usage_line
from mtp_jax.train.frozen import (
    add_run_arguments,
    attach_target_cache,
    bf16_rounded,
    draft_vocabulary,
    keep_vocabulary,
    own_text,
    report_for,
    run_training,
    ship,
    start_run,
)
from mtp_jax.train.loop import make_optimizer


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--attention",
        choices=["gqa", "mla"],
        help="the draft layer's attention (default: mla for a DeepSeek-V3 target, gqa for Llama)",
    )
    parser.add_argument(
        "--layer-ids",
        type=int,
        nargs=3,
        help="captured target layers as layer INPUT ids (default: 2, L/2, L-3, spread when they repeat)",
    )
    parser.add_argument("--draft-vocab", type=int, help="draft vocabulary size (default: half the target's)")
    parser.add_argument("--depth", type=int, default=5, help="chained steps of the training-time test")
    parser.add_argument("--step-decay", type=float, default=0.8, help="step j weighted DECAY^(j-1)")
    args = parser.parse_args()
    if args.card:
        rewrite_card(args.card, card)
        return 0
    if args.depth < 1:
        parser.error("--depth must be at least 1")
    if args.preset == "smoke":
        args.depth = min(args.depth, 3)

    def check(cfg: ModelConfig, data: str) -> None:
        layer_ids = args.layer_ids or spread_layer_ids(cfg.num_hidden_layers)
        if any(not 0 <= i < cfg.num_hidden_layers for i in layer_ids):
            parser.error(f"--layer-ids {layer_ids}: the target has layers 0..{cfg.num_hidden_layers - 1}")
        vocab = args.draft_vocab or cfg.vocab_size // 2
        if not 1 <= vocab <= cfg.vocab_size:
            parser.error(f"--draft-vocab {vocab} must be in [1, {cfg.vocab_size}] (the target's vocabulary)")

    run = start_run(args, parser, check)
    cfg, params = run.cfg, run.params
    attention = args.attention or ("mla" if isinstance(cfg, DeepseekV3Config) else "gqa")
    layer_ids = args.layer_ids or spread_layer_ids(cfg.num_hidden_layers)
    vocab = args.draft_vocab or cfg.vocab_size // 2
    own_windows = own_text(run)
    # the vocabulary a saved training state was trained with, whatever this run's data would choose
    vocab_file = os.path.join(run.workdir, "draft_vocabulary.npy")
    if os.path.isfile(vocab_file):
        ids = np.load(vocab_file)
    else:
        ids = draft_vocabulary(
            [run.train_stream] + ([own_windows] if own_windows is not None else []), cfg.vocab_size, vocab
        )
    raw = draft_config(run.target_raw, cfg, attention, layer_ids, vocab)
    dcfg, tree = init_draft(raw, cfg, params, ids, args.seed)
    fixed = {"draft_to_target": tree.pop("draft_to_target")}
    keep_vocabulary(vocab_file, np.asarray(fixed["draft_to_target"]))
    attach_target_cache(run, dcfg.capture, lambda hidden: fused_features(hidden.layers), "EAGLE-3")
    n_params = sum(x.size for x in jax.tree.leaves(tree))
    optimizer = make_optimizer(args, tree)

    @jax.jit
    def update(state: dict, batch: dict, target: dict) -> tuple[dict, dict]:
        # the frozen target is an argument, not a closure: XLA would fold a real model in as constants
        cached = {k: v for k, v in batch.items() if k != "window"} or None

        def objective(t):
            return draft_losses(
                {**t, **fixed}, target, cfg, dcfg, batch["window"], args.depth, args.step_decay, cached
            )

        tree = state["draft"]
        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(tree)
        updates, opt_state = optimizer.update(grads, state["opt_state"], tree)
        return {"draft": optax.apply_updates(tree, updates), "opt_state": opt_state}, aux

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        return update(state, batch, params)

    print(
        f"draft: EAGLE-3 ({attention.upper()}) for {cfg.model_type}, {n_params / 1e6:.2f}M parameters, "
        f"layer inputs {layer_ids}, draft vocabulary {vocab}/{cfg.vocab_size}; {args.steps} steps x "
        f"{args.batch} x {args.seq} tokens, {args.depth} chained steps, own text {run.own}/{args.batch}",
        file=sys.stderr,
    )

    def export(state: dict) -> dict:
        return eagle3_hub_tensors_from_params(
            {**state["draft"], **fixed}, dcfg, ml_dtypes.bfloat16, LAYER_PREFIX
        )

    def load(reader: CheckpointReader, raw: dict) -> dict:
        _, loaded = load_eagle3(reader, raw, cfg, params, jnp.float32, strict=True, verbose=False)
        # the draft vocabulary it was trained on, whatever this run's data would choose
        fixed["draft_to_target"] = loaded.pop("draft_to_target")
        keep_vocabulary(vocab_file, np.asarray(fixed["draft_to_target"]))
        return loaded

    state = {"draft": tree, "opt_state": optimizer.init(tree)}
    done = run_training(run, state, train_step, "eagle3", raw=raw, export=export, load=load)
    if done is None:
        return 0
    state, start, seconds = done
    tree = {**state["draft"], **fixed}
    tensors = eagle3_hub_tensors_from_params(tree, dcfg, ml_dtypes.bfloat16, LAYER_PREFIX)
    held = evaluate(
        bf16_rounded(tree),
        params,
        cfg,
        dcfg,
        run.held_stream,
        run.length,
        args.eval_windows,
        args.depth,
        args.step_decay,
    )
    draft = {
        "attention": attention,
        "layer_ids": layer_ids,
        "capture": list(dcfg.capture),
        "draft_vocab_size": vocab,
        "parameters": int(n_params),
    }
    training = {"depth": args.depth, "step_decay": args.step_decay}
    report = report_for(run, draft, training, held, start, seconds)
    ship(run, raw, tensors, report, "eagle3", card)
    return 0


def card(raw: dict, r: dict) -> str:
    d, t, h, dr = r["data"], r["training"], r["heldout"], r["draft"]
    note = f" ({t['note']})" if t.get("note") else ""
    mla = dr["attention"] == "mla"
    kind = (
        f"DeepSeek MLA ({raw['num_attention_heads']} heads, q/kv ranks "
        f"{raw['q_lora_rank']}/{raw['kv_lora_rank']}, SGLang's `Eagle3DeepseekV2ForCausalLM` layout)"
        if mla
        else f"Llama-style GQA ({raw['num_attention_heads']} heads, {raw['num_key_value_heads']} KV heads)"
    )
    steps = " / ".join(str(j + 1) for j in range(len(h["level_agreement"])))
    agree = " / ".join(f"{a:.3f}" for a in h["level_agreement"])
    acc, mtp = r.get("acceptance", {}), r.get("mtp_acceptance", {})
    if mtp:
        rows = "\n".join(
            f"| {k} | {v:.2f} | {mtp[k]:.2f} |" if k in mtp else f"| {k} | {v:.2f} | - |"
            for k, v in acc.items()
        )
        table = f"| K | EAGLE-3 | the target's own MTP |\n|---|---|---|\n{rows}"
    else:
        table = "| K | acceptance length |\n|---|---|\n" + "\n".join(
            f"| {k} | {v:.2f} |" for k, v in acc.items()
        )
    return f"""# EAGLE-3 draft for `{r["target"]}`

An EAGLE-3 draft for the `{r["target"]}` target of mtp-jax, written by
`scripts/train_eagle3.py`: one decoder layer with {kind}
over `fc(cat(low, mid, high))` of three target layers (layer inputs {dr["layer_ids"]}, as
`eagle_config.eagle_aux_hidden_state_layer_ids` reads them) and the embedding of the next token;
{dr["parameters"] / 1e6:.2f}M parameters of its own (the target's embedding is used, not stored).
Its head covers the {dr["draft_vocab_size"]} most frequent tokens of the training data (`d2t`
offsets, `t2d` mask); it proposes nothing else.
Hub layout: bf16 safetensors, `layers.0.*` keys.

{usage_line(r, "eagle3")}

## Training
{data_sentence(d)} {t["steps"]} steps of {t["batch"]} x
{t["seq"]} tokens, AdamW (lr {t["lr"]}, warm-up {t["warmup"]}, cosine decay), seed {t["seed"]};
EAGLE-3's training-time test: the draft unrolled {t["depth"]} steps on its own states with the
decode-time attention pattern, step j weighted {t["step_decay"]}^(j-1), labels the target's own
distribution over the draft vocabulary (self-distillation){own_text_clause(d, t)}. The target is frozen.
{t["batch"] * t["seq"] * t["steps"]:,} tokens trained.
{t["seconds"] / 60:.1f} minutes on {t["machine"]}{note}.
The command (resumable: rerun it after an interruption):

    {t["command"]}

## Held-out results (the shipped bf16 weights)
| | |
|---|---|
| teacher-forced agreement with the target's greedy token, chained steps {steps} | {agree} |
| soft cross-entropy of step 1 against the target | {h["level_loss"][0]:.3f} |
| target probability mass on the draft vocabulary | {h["coverage"]:.3f} |

Greedy acceptance length (tokens per step; {acceptance_setup(r)} in
`eval.json`):

{table}

Speed against plain decoding and the other drafts is in the repository's BENCHMARKS.md.
"""


if __name__ == "__main__":
    sys.exit(main())
