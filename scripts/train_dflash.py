"""Train a DFlash block-diffusion draft against a frozen target (the embedded tiny Llama 3 or
DeepSeek-V3) on the Python standard library, and write it in the published layout.

    python scripts/train_dflash.py --target checkpoints/tiny-llama3-stdlib \\
        --out checkpoints/tiny-llama3-stdlib-dflash
    python scripts/train_dflash.py --target checkpoints/tiny-deepseek-v3-stdlib \\
        --out checkpoints/tiny-deepseek-v3-stdlib-dflash
    python scripts/train_dflash.py --target DIR --out /tmp/smoke --preset smoke     # seconds

The draft (docs/formats.md, "DFlash drafts"; :mod:`mtp_jax.drafts.dflash.draft`): ``--layers`` Qwen3-style
decoder layers of the target's width over the context ``hidden_norm(fc(cat(features)))`` of
captured target layer outputs (``--layer-ids``, default: DFlash's choice for that many layers),
the target's embedding and head; a block is ``[anchor, MASK x (block_size - 1)]`` (MASK: the
tokenizer's ``<|pad|>``, never a real token of the text).

Recipe (DFlash, as SpecForge trains it): every window gets ``--anchors`` random anchor positions;
each anchored block sees the context strictly before its anchor and itself bidirectionally, blocks
never see each other; block row j (1..block_size-1) predicts the token at anchor + j, its loss
weighted exp(-(j-1)/``--gamma``) (normalised); the labels are the target's own next-token
distributions (soft cross-entropy: self-distillation), and ``--own-text`` of each batch is the
target's own greedy text. The target is frozen. Everything else (optimizer, resumable orbax state,
progress line, determinism, the shipped checkpoint with eval.json and a card) is
:mod:`mtp_jax.train.frozen`'s.
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
from mtp_jax.drafts.dflash.checkpoint import load_dflash
from mtp_jax.drafts.dflash.config import dflash_default_layers
from mtp_jax.drafts.dflash.draft import dflash_features
from mtp_jax.drafts.dflash.export import dflash_hub_tensors_from_params
from mtp_jax.drafts.dflash.training import (
    FIXED,
    PAD,
    anchors_for,
    draft_config,
    draft_losses,
    evaluate,
    init_draft,
)
from mtp_jax.train.cards import (
    acceptance_setup,
    data_sentence,
    own_text_clause,
    rewrite_card,
    usage_line,
)
from mtp_jax.train.frozen import (
    add_run_arguments,
    attach_target_cache,
    bf16_rounded,
    draft_vocabulary,
    keep_vocabulary,
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
    parser.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    parser.add_argument(
        "--layer-ids", type=int, nargs="+", help="captured target layer OUTPUTS (default: DFlash's)"
    )
    parser.add_argument("--block-size", type=int, default=8, help="tokens per block (anchor + drafts)")
    parser.add_argument("--anchors", type=int, default=16, help="anchored blocks per training window")
    parser.add_argument("--gamma", type=float, default=4.0, help="block row j weighted exp(-(j-1)/GAMMA)")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        help="restrict the block's head to the N most frequent training tokens (default: the target's "
        "whole vocabulary)",
    )
    parser.add_argument(
        "--mask-token-id",
        type=int,
        help="the mask token (default: <|pad|> of the embedded tokenizer; 0 for a chat target, whose "
        "conversations never contain it)",
    )
    args = parser.parse_args()
    if args.card:
        rewrite_card(args.card, card)
        return 0
    if args.layers < 1 or args.block_size < 2 or args.anchors < 1 or args.gamma <= 0:
        parser.error("--layers and --anchors must be >= 1, --block-size >= 2, --gamma > 0")
    if args.preset == "smoke":
        args.anchors, args.block_size = min(args.anchors, 4), min(args.block_size, 4)

    def check(cfg: ModelConfig, data: str) -> None:
        layer_ids = args.layer_ids or list(dflash_default_layers(cfg.num_hidden_layers, args.layers))
        if any(not 0 <= i < cfg.num_hidden_layers for i in layer_ids):
            parser.error(f"--layer-ids {layer_ids}: the target has layers 0..{cfg.num_hidden_layers - 1}")
        if args.seq < args.block_size:
            parser.error(f"--seq {args.seq} is shorter than a block of {args.block_size}")
        if args.mask_token_id is None:
            args.mask_token_id = 0 if data in ("chat", "corpus") else PAD  # chat text never holds id 0
        if args.draft_vocab is not None and not 1 <= args.draft_vocab <= cfg.vocab_size:
            parser.error(
                f"--draft-vocab {args.draft_vocab} must be in [1, {cfg.vocab_size}] (the target's vocabulary)"
            )
        if not 0 <= args.mask_token_id < cfg.vocab_size:
            parser.error(
                f"--mask-token-id {args.mask_token_id} is not a token id of the target "
                f"(0..{cfg.vocab_size - 1})"
            )

    run = start_run(args, parser, check)
    cfg, params = run.cfg, run.params
    layer_ids = args.layer_ids or list(dflash_default_layers(cfg.num_hidden_layers, args.layers))
    mask = args.mask_token_id
    raw = draft_config(run.target_raw, cfg, args.layers, layer_ids, args.block_size, mask)
    ids = None
    if args.draft_vocab is not None and args.draft_vocab < cfg.vocab_size:
        # the vocabulary a saved training state was trained with, whatever this run's data would choose
        vocab_file = os.path.join(run.workdir, "draft_vocabulary.npy")
        if os.path.isfile(vocab_file):
            ids = np.load(vocab_file)
        else:
            ids = draft_vocabulary([run.train_stream], cfg.vocab_size, args.draft_vocab)
        keep_vocabulary(vocab_file, ids)
        raw["draft_vocab_size"] = len(ids)
    dcfg, tree = init_draft(raw, cfg, args.seed, params, ids)
    fixed = {name: tree.pop(name) for name in FIXED if name in tree}
    n_params = sum(x.size for x in jax.tree.leaves(tree))
    optimizer = make_optimizer(args, tree)
    last = cfg.num_hidden_layers - 1 in dcfg.capture  # read final-normed: not DSpark's features then
    attach_target_cache(
        run,
        dcfg.capture,
        lambda hidden: dflash_features(dcfg, cfg.num_hidden_layers, hidden),
        "layer outputs, the last final-normed" if last else "layer outputs",
    )

    @jax.jit
    def update(state: dict, batch: dict, anchors: jax.Array, target: dict) -> tuple[dict, dict]:
        tree = state["draft"]  # the frozen target is an argument: a closure would be folded in as constants
        cached = {k: v for k, v in batch.items() if k != "window"} or None

        def objective(t: dict) -> tuple[jax.Array, dict]:
            return draft_losses(
                {**t, **fixed}, target, cfg, dcfg, batch["window"], anchors, args.gamma, cached
            )

        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(tree)
        updates, opt_state = optimizer.update(grads, state["opt_state"], tree)
        return {
            "draft": optax.apply_updates(tree, updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }, aux

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        step = int(state["step"])  # the anchors of a step come from (seed, step): a resumed run redraws them
        b, length = batch["window"].shape
        anchors = anchors_for(args.seed, step, b, args.anchors, length - 1, args.block_size)
        return update(state, batch, jnp.asarray(anchors), params)

    print(
        f"draft: DFlash for {cfg.model_type}, {args.layers} layers, {n_params / 1e6:.2f}M parameters, target "
        f"layer outputs {layer_ids}, block {args.block_size}, {args.anchors} anchors a window; {args.steps} "
        f"steps x {args.batch} x {args.seq} tokens, own text {run.own}/{args.batch}",
        file=sys.stderr,
    )
    state = {"draft": tree, "opt_state": optimizer.init(tree), "step": jnp.zeros((), jnp.int32)}

    def load(reader: CheckpointReader, raw: dict) -> dict:
        """A partial's trained tensors (its vocabulary, if any, is this run's: ``fixed``)."""
        own = {k: v for k, v in raw.items() if k != "draft_vocab_size"}
        tree = load_dflash(reader, own, cfg, jnp.float32, strict=False, verbose=False)[1]
        return {k: v for k, v in tree.items() if k not in FIXED}

    done = run_training(
        run,
        state,
        train_step,
        "dflash",
        raw=raw,
        export=lambda st: dflash_hub_tensors_from_params({**st["draft"], **fixed}, dcfg, ml_dtypes.bfloat16),
        load=load,
        may_differ=("draft_vocab_size",),
    )
    if done is None:
        return 0
    state, start, seconds = done
    tree = state["draft"]
    tensors = dflash_hub_tensors_from_params({**tree, **fixed}, dcfg, ml_dtypes.bfloat16)
    held = evaluate(
        {**bf16_rounded(tree), **fixed},
        params,
        cfg,
        dcfg,
        run.held_stream,
        run.length,
        args.eval_windows,
        args.anchors,
        args.gamma,
    )
    draft = {
        "layers": args.layers,
        "layer_ids": layer_ids,
        "block_size": args.block_size,
        "parameters": int(n_params),
        "draft_vocab_size": None if ids is None else len(ids),
    }
    training = {"anchors": args.anchors, "gamma": args.gamma}
    report = report_for(run, draft, training, held, start, seconds)
    ship(run, raw, tensors, report, "dflash", card)
    return 0


def card(raw: dict, r: dict) -> str:
    d, t, h, dr = r["data"], r["training"], r["heldout"], r["draft"]
    note = f" ({t['note']})" if t.get("note") else ""
    rows = " / ".join(str(j + 1) for j in range(len(h["level_agreement"])))
    agree = " / ".join(f"{a:.3f}" for a in h["level_agreement"])
    acc, mtp = r.get("acceptance", {}), r.get("mtp_acceptance", {})
    lines = "\n".join(f"| {k} | {v:.2f} | {f'{mtp[k]:.2f}' if k in mtp else '-'} |" for k, v in acc.items())
    vocab, coverage = "", ""
    if dr.get("draft_vocab_size"):
        vocab = (
            f" Its block's head is the target's restricted to the {dr['draft_vocab_size']:,} most frequent "
            "tokens of the training data (`d2t` in the checkpoint; the target head's columns for them "
            "are copied at load, not stored)."
        )
        coverage = f"\n| target probability mass on the draft vocabulary | {h['coverage']:.3f} |"
    return f"""# DFlash draft for `{r["target"]}`

A DFlash block-diffusion draft for the `{r["target"]}` target of mtp-jax, written by
`scripts/train_dflash.py`: {dr["layers"]} Qwen3-style decoder layers ({raw["num_attention_heads"]} heads,
{raw["num_key_value_heads"]} KV heads, q/k norms) over the context `hidden_norm(fc(cat(...)))` of
target layer outputs {dr["layer_ids"]}; {dr["parameters"] / 1e6:.2f}M parameters of its own (the
target's embedding and head are used). One forward over `[anchor, MASK x {dr["block_size"] - 1}]`
proposes up to {dr["block_size"] - 1} drafts.{vocab} Published layout (`DFlashDraftModel`), bf16.

{usage_line(r, "dflash")}

## Training
{data_sentence(d)} {t["steps"]} steps of {t["batch"]} x {t["seq"]} tokens, AdamW (lr {t["lr"]},
warm-up {t["warmup"]}, cosine decay), seed {t["seed"]}; {t["anchors"]} random anchors per window,
each block over the context before its anchor and bidirectional within itself, row j weighted
exp(-(j-1)/{t["gamma"]}); labels the target's own distribution (self-distillation){own_text_clause(d, t)}.
The target is frozen.
{t["batch"] * t["seq"] * t["steps"]:,} tokens trained.
{t["seconds"] / 60:.1f} minutes on {t["machine"]}{note}. The command (resumable):

    {t["command"]}

## Held-out results (the shipped bf16 weights)
| | |
|---|---|
| agreement with the target's greedy token, block rows {rows} | {agree} |{coverage}

Greedy acceptance length (tokens per step; {acceptance_setup(r)}):

| K | DFlash | the target's own MTP |
|---|---|---|
{lines}

Speed against plain decoding and the other drafts is in the repository's BENCHMARKS.md.
"""


if __name__ == "__main__":
    sys.exit(main())
