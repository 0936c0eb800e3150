"""Train the embedded models: a tiny DeepSeek-V3 (MLA, a dense layer then MoE layers with
group-limited routing) jointly with its MTP layer, and a tiny Llama 3 (``--arch llama``), on the
Python standard library's source code.

    python scripts/train_tiny.py --out /tmp/base                                     # ~35 min, 2 cores
    python scripts/train_tiny.py --out checkpoints/tiny-deepseek-v3-stdlib --init-from /tmp/base \
        --train mtp --mtp-depth 4 --mtp-labels target --own-text 0.5 --steps 1000 --lr 1e-3 \
        --warmup 50 --seed 1 --acceptance-k 1 2 3 4 5                                # ~27 min
    python scripts/train_tiny.py --arch llama --out checkpoints/tiny-llama3-stdlib \
        --tokenizer-from checkpoints/tiny-deepseek-v3-stdlib --steps 1500           # the Llama target
    python scripts/train_tiny.py --arch llama --preset draft --out checkpoints/tiny-llama3-stdlib-draft \
        --tokenizer-from checkpoints/tiny-deepseek-v3-stdlib --steps 1500           # its draft model
    python scripts/train_tiny.py --out /tmp/smoke --preset smoke --steps 3          # seconds

The tiny Llama 3 (GQA, llama3 rope scaling, SwiGLU, untied head) is trained on the same text, split
and tokenizer as the DeepSeek-V3 (``--tokenizer-from``): it is the target the EAGLE-3 and DFlash
drafts are trained against. Its objective is next-token cross-entropy alone. ``--preset draft``
makes a 2-layer, 64-wide Llama on the same text and tokenizer: a separate draft model
(``draft="draft_model"``) for either tiny target.

Data: every ``.py`` file of this interpreter's standard library (tests, demos and site-packages
excluded), split by module into train and held-out sets by a hash of the module path. A byte-level
BPE tokenizer is trained on the train split with ``tokenizers`` and saved as ``tokenizer.json``.
Each module is one document: ``<|bos|> tokens <|eos|>``; training windows are drawn at random
offsets of the concatenated train stream (seeded by ``--seed`` and the step, so a resumed run sees
the same batches).

Objective (DeepSeek-V3 report, section 2.2): next-token cross-entropy plus λ = 0.3 times the MTP
cross-entropy (the MTP layer predicts t_{i+2} from the main model's final hidden state h_i and the
embedding of t_{i+1}; it shares the embedding and output head). Experts are balanced the
auxiliary-loss-free way: after each step every routed expert's correction bias moves by γ towards
the mean load (bias += γ · sign(mean load - load)); the bias only steers selection, never the
weights. AdamW with warm-up and cosine decay, gradient clipping at 1.0.

Speculative decoding chains the MTP layer: draft 1 comes from the target's hidden state, draft j > 1
from the layer's own output state and draft j-1. The report's objective trains only the first use,
and the chained drafts are accepted far less often. ``--mtp-depth D`` adds the chained uses to the
loss: level j feeds level j-1's state back with the true token t_{i+j} and predicts t_{i+j+1}, its
attention seeing exactly what the decode-time cache holds (the first-level rows before it and its
own chain; :func:`mtp_jax.drafts.mtp.draft.mtp_chain_teacher_forced`); levels are weighted REACH^(j-1).
``--mtp-labels target`` trains the levels on the main model's own distributions instead of the
text's tokens (self-distillation): a draft is accepted when it matches the target, not the text.
``--init-from DIR --train mtp`` starts from a trained checkpoint and trains the MTP layer alone with
the main model frozen, so the target's weights and outputs stay bit for bit the same (the shipped
model is made so: the first command above, then the second). ``--own-text F`` (with ``--train mtp``)
takes a fraction F of each batch from the main model's own greedy continuations of training-text
prompts, generated once before training: at temperature 0 a draft is scored on the target's own
text, whose contexts differ from the standard library's (loops, the model's habits).

The training state (parameters, optimizer state, step) is saved with orbax to ``--workdir`` every
``--save-every`` steps; rerunning the same command resumes from the latest save. At the end the
model is written in the exact Hugging Face layout (bf16 safetensors, ``config.json`` with
``num_nextn_predict_layers: 1``, the MTP layer as layer N, tokenizer, generation config, a model
card and ``eval.json`` with the held-out numbers that the tests check), atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

import jax
import numpy as np
import optax
from tokenizers import Tokenizer

from mtp_jax.config import ModelConfig, parse_config
from mtp_jax.drafts.mtp import card as mtp_card
from mtp_jax.drafts.mtp.training import BIAS_RATE, MTP_WEIGHT, balance_bias
from mtp_jax.drafts.mtp.training import losses as mtp_losses
from mtp_jax.targets.deepseek_v3 import tiny as deepseek_tiny
from mtp_jax.targets.llama import tiny as llama_tiny
from mtp_jax.train import cards
from mtp_jax.train.data import (
    BOS,
    EOS,
    SPECIAL,
    continuations_path,
    data_report,
    load_or_make_continuations,
    read_text,
    stdlib_modules,
    token_stream,
    train_tokenizer,
)
from mtp_jax.train.frozen import load_params
from mtp_jax.train.loop import make_optimizer, run_report, train_loop
from mtp_jax.train.tiny import evaluate, initial_params, target_losses, write_checkpoint

# --arch -> the family's tiny configurations and initial weights, and its card
FAMILIES = {"deepseek_v3": (deepseek_tiny, mtp_card.tiny_card), "llama": (llama_tiny, llama_tiny.tiny_card)}


def model_config(vocab_size: int, preset: str, arch: str = "deepseek_v3") -> dict:
    """The architecture of ``arch`` at ``preset``'s size, with this data's special tokens."""
    return FAMILIES[arch][0].tiny_config(vocab_size, preset, BOS, EOS)


def losses(
    params: dict, cfg: ModelConfig, window: jax.Array, depth: int = 1, labels: str = "data"
) -> tuple[jax.Array, dict]:
    """The objective: a Llama target's next-token cross-entropy alone (it has no draft layer), a
    DeepSeek-V3's jointly with its MTP layer (:func:`mtp_jax.drafts.mtp.training.losses`)."""
    if cfg.model_type == "deepseek_v3":
        return mtp_losses(params, cfg, window, depth, labels)
    if labels not in ("data", "target"):
        raise ValueError(f"labels must be 'data' or 'target', got {labels!r}")
    return target_losses(params, cfg, window)


def card_for(config: dict, report: dict) -> str:
    return FAMILIES[config["model_type"]][1](config, report)


def rewrite_card(directory: str) -> None:
    """:func:`mtp_jax.train.cards.rewrite_card` with the family's card."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        arch = json.load(f)["model_type"]
    cards.rewrite_card(directory, FAMILIES[arch][1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="checkpoint directory to write (must not exist)")
    parser.add_argument(
        "--card", metavar="DIR", help="only rewrite DIR/README.md from its config.json and eval.json"
    )
    parser.add_argument("--workdir", help="orbax training state, for resuming (default: OUT.train)")
    parser.add_argument(
        "--preset",
        default="default",
        choices=["default", "smoke", "draft"],
        help="model size; 'draft' (Llama only): a 2-layer, 64-wide Llama, the tiny Llama's draft model",
    )
    parser.add_argument(
        "--arch",
        default="deepseek_v3",
        choices=["deepseek_v3", "llama"],
        help="deepseek_v3 (with its MTP layer) or llama (a Llama 3 target, next-token loss only)",
    )
    parser.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size")
    parser.add_argument(
        "--tokenizer-from",
        metavar="DIR",
        help="use DIR/tokenizer.json instead of training one (the same tokenizer as that model)",
    )
    parser.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from this trained checkpoint (its config, tokenizer and weights) instead of "
        "random weights; --preset and --vocab are then ignored",
    )
    parser.add_argument(
        "--train",
        default="all",
        choices=["all", "mtp"],
        help="what is trained: everything (main + MTP loss), or only the MTP layer on its chained "
        "loss with the main model frozen (its outputs then stay exactly as they were)",
    )
    parser.add_argument(
        "--mtp-labels",
        default="data",
        choices=["data", "target"],
        help="what the MTP levels learn: the text's tokens (DeepSeek-V3) or the main model's own "
        "distribution there (self-distillation: what greedy acceptance measures)",
    )
    parser.add_argument(
        "--mtp-depth",
        type=int,
        default=1,
        help="chained MTP levels in the loss: 1 = the DeepSeek-V3 objective (t+2 only); D also "
        "trains the layer fed its own state for t+3..t+D+1, as speculative decoding chains it",
    )
    parser.add_argument(
        "--own-text",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="with --train mtp: this fraction of each batch is the main model's own greedy continuations "
        "of training-text prompts (generated once before training; on-policy distillation data)",
    )
    parser.add_argument(
        "--own-text-windows", type=int, default=2048, help="how many own-continuation windows to generate"
    )
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256, help="training window (tokens)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--max-files", type=int, help="use only the first N modules (smoke tests)")
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument(
        "--stop-after", type=int, help="stop after this many steps in this run (state saved; rerun to resume)"
    )
    parser.add_argument(
        "--acceptance-k", type=int, nargs="*", default=[1, 2, 3, 4], help="K values measured for the card"
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit 2, nothing written) for a missing or clashing option."""
    if not args.out:
        parser.error("--out is required")
    if os.path.exists(args.out):
        parser.error(f"--out {args.out} already exists; choose a new directory")
    if args.mtp_depth < 1:
        parser.error("--mtp-depth must be at least 1")
    if args.preset == "draft" and args.arch != "llama":
        parser.error("--preset draft is a Llama draft model: give --arch llama")
    if args.train == "mtp" and not args.init_from:
        parser.error("--train mtp fine-tunes a trained model's draft: give --init-from")
    if not 0.0 <= args.own_text <= 1.0:
        parser.error(f"--own-text is a fraction in [0, 1], got {args.own_text}")
    if args.own_text and args.train != "mtp":
        parser.error("--own-text needs --train mtp (the main model must not change under its own text)")
    if args.own_text and round(args.own_text * args.batch) == 0:
        parser.error(f"--own-text {args.own_text} of a batch of {args.batch} is not one window")
    if args.own_text_windows < 1:
        parser.error("--own-text-windows must be at least 1")
    if args.init_from and not os.path.isfile(os.path.join(args.init_from, "tokenizer.json")):
        parser.error(f"--init-from {args.init_from} is not a trained checkpoint (no tokenizer.json)")
    if args.tokenizer_from and not os.path.isfile(os.path.join(args.tokenizer_from, "tokenizer.json")):
        parser.error(f"--tokenizer-from {args.tokenizer_from} has no tokenizer.json")
    if args.arch == "llama" and (args.train != "all" or args.mtp_depth != 1 or args.mtp_labels != "data"):
        parser.error("--arch llama trains the whole model on next-token loss: no --train/--mtp-* options")


def load_data(args: argparse.Namespace) -> tuple:
    """The standard library's modules split, the tokenizer (trained or given) and both token streams."""
    t0 = time.perf_counter()
    root, train_files, held_files = stdlib_modules(args.max_files)
    train_texts = [read_text(root, p) for p in train_files]
    held_texts = [read_text(root, p) for p in held_files]
    print(
        f"data: {len(train_files)} train / {len(held_files)} held-out modules from {root} "
        f"({sum(map(len, train_texts)) / 1e6:.1f} MB of code)",
        file=sys.stderr,
    )
    tokenizer_dir = args.init_from or args.tokenizer_from
    if tokenizer_dir:
        tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        if tok.token_to_id(SPECIAL[BOS]) != BOS or tok.token_to_id(SPECIAL[EOS]) != EOS:
            raise SystemExit(
                f"{tokenizer_dir}/tokenizer.json does not have {SPECIAL[:2]} at ids {BOS}, {EOS}"
            )
    else:
        tok = train_tokenizer(train_texts, args.vocab)
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(
        f"tokenizer: {tok.get_vocab_size()} BPE tokens; {len(train_stream):,} train / {len(held_stream):,} "
        f"held-out tokens ({time.perf_counter() - t0:.0f}s)",
        file=sys.stderr,
    )
    return tok, train_files, held_files, held_texts, train_stream, held_stream


def starting_model(args: argparse.Namespace, tok: Tokenizer) -> tuple[dict, ModelConfig, dict, dict | None]:
    """(config.json, config, parameters, the start's eval.json or None): a trained checkpoint
    (``--init-from``) or the family's tiny preset with fresh weights."""
    if not args.init_from:
        config = model_config(tok.get_vocab_size(), args.preset, args.arch)
        cfg = parse_config(config)
        family = FAMILIES[args.arch][0]
        return config, cfg, initial_params(cfg, config, family.tiny_tensors(cfg, args.seed)), None
    with open(os.path.join(args.init_from, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    cfg = parse_config(config)
    base = None
    eval_path = os.path.join(args.init_from, "eval.json")
    if os.path.isfile(eval_path):
        with open(eval_path, encoding="utf-8") as f:
            base = json.load(f)
    return config, cfg, load_params(args.init_from, cfg), base


def make_step(args: argparse.Namespace, cfg: ModelConfig, params: dict):
    """(optimizer state, the jitted step over {"params", "opt_state"}): the whole model on its loss,
    or with ``--train mtp`` the MTP layer alone on its chained loss (the rest frozen)."""
    only_mtp, has_mtp = args.train == "mtp", "mtp" in params

    def trainable(params: dict) -> dict:
        return params["mtp"] if only_mtp else params

    optimizer = make_optimizer(args, trainable(params))

    @jax.jit
    def train_step(params, opt_state, window):
        def objective(part):
            full = {**params, "mtp": part} if only_mtp else part
            total, aux = losses(full, cfg, window, args.mtp_depth, args.mtp_labels)
            return (aux["draft_loss"] if only_mtp else total), aux

        part = trainable(params)
        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(part)
        updates, opt_state = optimizer.update(grads, opt_state, part)
        part = optax.apply_updates(part, updates)
        params = {**params, "mtp": part} if only_mtp else part
        if has_mtp:
            params = balance_bias(params, aux, target=not only_mtp)
        return params, opt_state, aux

    def step_fn(state: dict, window: jax.Array) -> tuple[dict, dict]:
        params, opt_state, aux = train_step(state["params"], state["opt_state"], window)
        return {"params": params, "opt_state": opt_state}, aux

    return optimizer.init(trainable(params)), step_fn


def training_report(args, own: int, aux, start: int, seconds: float, has_mtp: bool) -> dict:
    """eval.json's "training": the run's settings (a target alone records no draft settings)."""
    loads = np.asarray(aux["moe_load"]) if aux is not None and "moe_load" in aux else None
    report = {
        **run_report(args),
        "mtp_weight": MTP_WEIGHT,
        "trained": args.train,
        "mtp_depth": args.mtp_depth,
        "mtp_labels": args.mtp_labels,
        "own_text": args.own_text,
        "own_text_windows": args.own_text_windows if own else 0,
        "init_from": os.path.basename(os.path.normpath(args.init_from)) if args.init_from else None,
        "bias_rate": BIAS_RATE,
        "seconds": round(seconds, 1),
        "resumed_from": start,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__}",
        "final_expert_load_min_max": None if loads is None else [float(loads.min()), float(loads.max())],
        "tokenizer_from": args.tokenizer_from and os.path.basename(os.path.normpath(args.tokenizer_from)),
        "preset": args.preset,
    }
    if not has_mtp:
        for key in ("mtp_weight", "mtp_depth", "mtp_labels", "own_text", "own_text_windows", "bias_rate"):
            report.pop(key)
        report.pop("final_expert_load_min_max")
    return report


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.card:
        rewrite_card(args.card)
        return 0
    check_args(parser, args)
    workdir = os.path.abspath(args.workdir or args.out.rstrip("/") + ".train")
    t0 = time.perf_counter()
    tok, train_files, held_files, held_texts, train_stream, held_stream = load_data(args)
    config, cfg, params, base = starting_model(args, tok)
    has_mtp = "mtp" in params
    n_params = sum(x.size for x in jax.tree.leaves(params))
    opt_state, step_fn = make_step(args, cfg, params)
    length = args.seq + 1
    own = round(args.own_text * args.batch)
    own_windows = None
    if own:
        own_windows = load_or_make_continuations(
            workdir, cfg, params, train_stream, args.own_text_windows, length, args.seed
        )
    objective = f" (MTP depth {args.mtp_depth})" if has_mtp else " (next-token loss)"
    print(
        f"model: {cfg.model_type}, {n_params / 1e6:.2f}M parameters; training "
        f"{'the MTP layer' if args.train == 'mtp' else 'all'}{objective} for {args.steps} steps x "
        f"{args.batch} x {args.seq} tokens",
        file=sys.stderr,
    )
    state = {"params": params, "opt_state": opt_state}
    done = train_loop(args, workdir, state, step_fn, train_stream, own_windows)
    if done is None:
        return 0
    state, aux, start, train_seconds = done
    params = state["params"]

    held = evaluate(losses, params, cfg, held_stream, length, args.eval_windows, max(args.mtp_depth, 3))
    drafting = ""
    if has_mtp:
        drafting = (
            f", MTP loss {held['mtp_loss']:.3f}, teacher-forced MTP agreement by level "
            f"{' '.join(f'{a:.3f}' for a in held['level_agreement'])}"
        )
    print(
        f"held-out: loss {held['loss']:.3f} (perplexity {held['perplexity']:.2f}){drafting}",
        file=sys.stderr,
    )
    report = {
        "data": data_report(train_files, held_files, train_stream, held_stream),
        "training": training_report(args, own, aux, start, train_seconds, has_mtp),
        "parameters": int(n_params),
        "heldout": held,
        "heldout_modules": held_files,
    }
    if base is not None:  # the run this one started from, as its own eval.json recorded it
        report["base"] = {k: base[k] for k in ("training", "heldout", "acceptance") if k in base}
        if "base" in base:
            report["base"]["base"] = base["base"]
    write_checkpoint(args.out, config, cfg, params, tok, report, held_texts, args.acceptance_k, card_for)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f}s in all)", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)
    if own:
        os.remove(continuations_path(workdir, args.own_text_windows, length, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
