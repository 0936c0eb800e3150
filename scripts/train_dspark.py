"""Train a DSpark draft (DeepSpec's block draft with a sequential head and a confidence head) against a
frozen target, calibrate its confidences on held-out rollouts, and write it in DeepSpec's layout.

    python scripts/train_dspark.py --target checkpoints/tiny-deepseek-v3-stdlib \\
        --out checkpoints/tiny-deepseek-v3-stdlib-dspark
    python scripts/train_dspark.py --target DIR --out /tmp/smoke --preset smoke     # seconds

The draft (docs/formats.md, "DSpark drafts"; :mod:`mtp_jax.drafts.dspark`): DFlash's backbone
(``--layers`` Qwen3-style layers at the target's width over the captured target layer outputs
``--layer-ids``, -1 the embedding) run once over ``[anchor, MASK x (block - 1)]``, every slot
predicting a token (the anchor's slot the next one: a block of B gives B drafts), then per slot the
target's head plus a ``--head`` Markov bias of rank ``--markov-rank`` read from the previous token,
and a confidence head (``--no-confidence`` leaves it out).

Recipe (DeepSpec's, ../shared/DSPARK.md section 3): ``--anchors`` random anchors per window; each
block sees the context strictly before its anchor and itself; teacher forcing (slot k's previous
token the text's own); per slot 0.1 x cross-entropy of the true token + 0.9 x the L1 distance to the
target's distribution + 1.0 x the confidence head's BCE against the analytic acceptance
sum(min(p_draft, p_target)), slots weighted exp(-k / ``--decay``)
(:func:`mtp_jax.drafts.dspark.losses.dspark_losses`). The target, its embedding and head are frozen.

Calibration (paper section 3.2.1): the trained draft runs speculative sampling (temperature 1, the
whole block) on the first half of the target's held-out prompts (``--acceptance-prompts`` of them
when given), ``--calibration-seeds`` seeds
each, recording every step's confidence logits and how many of its drafts were accepted
(``Model.generate(on_verified=...)``); per slot, left to right, a temperature and a shift by the
log-loss (``--calibration scaling``, the default:
:func:`mtp_jax.drafts.dspark.calibration.fit_scaling`) or the paper's temperature alone by the ECE
(``--calibration temperature``: ``fit_temperatures``), stored in config.json as
``confidence_temperatures`` (and ``confidence_shifts``). The second half measures it: the expected
accepted length the calibrated confidences give against the observed one (and the paper's
temperatures' beside it), in eval.json and the card. ``--recalibrate DIR`` does only this for a
shipped draft (its config.json, eval.json and card rewritten in place).

Everything else (optimizer, resumable orbax state, ``--export-every``, the target cache, the
progress line, the shipped checkpoint with eval.json and a card) is :mod:`mtp_jax.train.frozen`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader, write_hub_checkpoint
from mtp_jax.config import ModelConfig
from mtp_jax.drafts.dflash.config import dflash_default_layers
from mtp_jax.drafts.dflash.training import PAD, anchors_for
from mtp_jax.drafts.dspark.calibration import (
    expected_calibration_error,
    fit_scaling,
    fit_temperatures,
    prefix_labels,
)
from mtp_jax.drafts.dspark.checkpoint import (
    FROZEN,
    dspark_hub_tensors_from_params,
    load_dspark,
)
from mtp_jax.drafts.dspark.config import HEAD_TYPES
from mtp_jax.drafts.dspark.draft import dspark_features
from mtp_jax.drafts.dspark.losses import LossWeights
from mtp_jax.drafts.dspark.training import FIXED, draft_config, draft_losses, evaluate, init_draft
from mtp_jax.embedded import resolve_model_path
from mtp_jax.train.cards import (
    acceptance_setup,
    data_sentence,
    own_text_clause,
    rewrite_card,
    usage_line,
)
from mtp_jax.train.data import BOS
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
from mtp_jax.train.shards import write_json

CALIBRATION_TOKENS = 64
"""New tokens per calibration rollout."""


@dataclasses.dataclass
class Rollouts:
    """Speculative steps recorded through ``generate(on_verified=...)``: each step's confidence
    logits [n, K] (as the draft gives them), drafts verified [n] and accepted [n]."""

    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    verified: list[np.ndarray] = dataclasses.field(default_factory=list)
    accepted: list[np.ndarray] = dataclasses.field(default_factory=list)

    def record(self, logits: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        self.logits.append(np.asarray(logits, np.float64))
        self.verified.append(np.asarray(verified))
        self.accepted.append(np.asarray(accepted))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(np.concatenate(x) for x in (self.logits, self.verified, self.accepted))


def record_rollouts(
    target: str, draft: str, prompts: list[list[int]], seeds: int, new_tokens: int
) -> Rollouts:
    """Speculative sampling (temperature 1, the whole block verified) of every prompt with ``seeds``
    seeds each, the draft at ``draft`` loaded beside ``target``; every step recorded."""
    model = mtp_jax.load(target, "float32", draft_model=draft)
    rollouts = Rollouts()
    batch = [p for p in prompts for _ in range(seeds)]
    model.generate(
        batch,
        max_new_tokens=new_tokens,
        temperature=1.0,
        seed=list(range(len(batch))),
        draft="dspark",
        draft_sampling="sampled",
        max_batch=16,
        on_verified=rollouts.record,
    )
    return rollouts


def calibration_report(
    logits: np.ndarray, verified: np.ndarray, accepted: np.ndarray, temps, shifts=None
) -> dict:
    """On recorded steps: the ECE of each slot's cumulative confidence against its prefix label
    (under the temperatures ``temps`` and ``shifts``, None: uncalibrated), and the mean accepted
    drafts per step the confidences expect (sum over the verified drafts of the running products)
    against the observed mean."""
    slots = logits.shape[1]
    scaled = logits if temps is None else logits / np.asarray(temps[:slots])[None, :]
    scaled = scaled if shifts is None else scaled + np.asarray(shifts[:slots])[None, :]
    a = np.cumprod(1 / (1 + np.exp(-scaled)), axis=1)
    labels, observed = prefix_labels(accepted, verified, slots)
    ece = [expected_calibration_error(a[observed[:, k], k], labels[observed[:, k], k]) for k in range(slots)]
    expected = float(np.sum(np.where(observed, a, 0.0)) / len(a))
    return {
        "steps": int(len(a)),
        "ece_per_slot": [round(e, 4) for e in ece],
        "expected_accepted_per_step": round(expected, 4),
        "observed_accepted_per_step": round(float(np.mean(accepted)), 4),
    }


CALIBRATION_FIELDS = ("confidence_temperatures", "confidence_shifts")


def calibrate(
    target: str, draft: str, prompts: list[list[int]], block: int, seeds: int, new_tokens: int, method: str
) -> tuple[dict, dict]:
    """Fit the calibration of the uncalibrated draft at ``draft`` (``method``: "scaling" or
    "temperature") on rollouts of the first half of ``prompts`` and measure it on the second half.
    Returns (the config.json fields, the report)."""
    if len(prompts) < 2:
        raise SystemExit("calibration needs at least two held-out prompts")
    fit, check = prompts[: len(prompts) // 2], prompts[len(prompts) // 2 :]
    fitted = record_rollouts(target, draft, fit, seeds, new_tokens).arrays()
    held = record_rollouts(target, draft, check, seeds, new_tokens).arrays()
    labels, observed = prefix_labels(fitted[2], fitted[1], fitted[0].shape[1])
    paper = fit_temperatures(fitted[0], labels, observed)
    temps, shifts = fit_scaling(fitted[0], labels, observed) if method == "scaling" else (paper, None)

    def full(values, fill):  # slots no rollout reached keep the identity
        return None if values is None else tuple(values) + (fill,) * (block - len(values))

    temps, shifts, paper = full(temps, 1.0), full(shifts, 0.0), full(paper, 1.0)
    report = {
        "method": method,
        "seeds_per_prompt": seeds,
        "new_tokens": new_tokens,
        "temperatures": [round(t, 4) for t in temps],
        **({} if shifts is None else {"shifts": [round(x, 4) for x in shifts]}),
        "fit": {"prompts": len(fit), **calibration_report(*fitted, temps, shifts)},
        "heldout_uncalibrated": {"prompts": len(check), **calibration_report(*held, None)},
        "heldout": {"prompts": len(check), **calibration_report(*held, temps, shifts)},
    }
    if shifts is not None:  # the paper's temperatures on the same rollouts, for comparison
        report["heldout_temperature_only"] = {"prompts": len(check), **calibration_report(*held, paper)}
    h = report["heldout"]
    print(
        f"calibration ({method}): temperatures {report['temperatures']}"
        + ("" if shifts is None else f", shifts {report['shifts']}")
        + f"; held-out expected {h['expected_accepted_per_step']:.3f} against observed "
        f"{h['observed_accepted_per_step']:.3f} accepted drafts per step ({h['steps']} steps)",
        file=sys.stderr,
    )
    fields = {"confidence_temperatures": [round(t, 6) for t in temps]}
    if shifts is not None:
        fields["confidence_shifts"] = [round(x, 6) for x in shifts]
    return fields, report


def held_prompt_ids(report: dict, target: str) -> list[list[int]]:
    """A shipped draft's held-out prompts (its eval.json) as the target sees them: chat data's user
    turns rendered with the target's template, a corpus's already rendered, stdlib's after BOS."""
    codec = mtp_jax.load(target, "float32").text
    kind = report.get("data", {}).get("kind")
    if kind == "chat":
        return [codec.encode_chat([{"role": "user", "content": t}]) for t in report["prompts"]]
    ids = [codec.tokenizer.encode(t, add_special_tokens=False).ids for t in report["prompts"]]
    return ids if kind == "corpus" else [[BOS, *x] for x in ids]


def recalibrate(directory: str, args: argparse.Namespace) -> int:
    """Calibrate a shipped draft again (``--recalibrate``): its rollouts with the calibration
    removed, then config.json, eval.json's "calibration" and the card rewritten (each atomically)."""
    paths = {name: os.path.join(directory, name) for name in ("config.json", "eval.json")}
    if not all(os.path.isfile(p) for p in paths.values()):
        raise SystemExit(
            f"--recalibrate {directory}: not a draft written by this script (config.json, eval.json)"
        )
    with open(paths["config.json"], encoding="utf-8") as f:
        raw = json.load(f)
    with open(paths["eval.json"], encoding="utf-8") as f:
        report = json.load(f)
    if not raw.get("enable_confidence_head"):
        raise SystemExit(f"--recalibrate {directory}: the draft has no confidence head")
    report["draft"]["frozen_copies"] = "lm_head.weight" in CheckpointReader(directory).keys()
    given = args.target or report.get("target_path") or report["target"]
    try:
        target = resolve_model_path(given)
    except FileNotFoundError as e:
        raise SystemExit(f"--recalibrate {directory}: its target {given!r}: {e} (give --target)") from None
    if not os.path.exists(target):
        raise SystemExit(f"--recalibrate {directory}: its target {given!r} is not found here (give --target)")
    before = report.get("calibration", {})
    count = args.acceptance_prompts  # default: the prompts its calibration had
    if count is None and "fit" in before:
        count = before["fit"]["prompts"] + before["heldout"]["prompts"]
    prompts = held_prompt_ids(report, target)[:count]
    seeds = before.get("seeds_per_prompt", args.calibration_seeds)
    with tempfile.TemporaryDirectory() as tmp:  # the weights beside a config without the calibration
        for name in os.listdir(directory):
            if name.endswith(".safetensors"):
                os.symlink(os.path.abspath(os.path.join(directory, name)), os.path.join(tmp, name))
        plain = {k: v for k, v in raw.items() if k not in CALIBRATION_FIELDS}
        write_json(os.path.join(tmp, "config.json"), plain, indent=2)
        fields, report["calibration"] = calibrate(
            target,
            tmp,
            prompts,
            raw["block_size"],
            seeds,
            before.get("new_tokens", CALIBRATION_TOKENS),
            args.calibration,
        )
    write_json(paths["config.json"], {**plain, **fields}, indent=2)
    write_json(paths["eval.json"], report, indent=2)
    rewrite_card(directory, card)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser)
    parser.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    parser.add_argument(
        "--layer-ids",
        type=int,
        nargs="+",
        help="captured target layer OUTPUTS, -1 the embedding (default: DFlash's choice for --layers)",
    )
    parser.add_argument(
        "--block-size", type=int, default=7, help="drafts per block (the anchor's slot first)"
    )
    parser.add_argument("--anchors", type=int, default=16, help="anchored blocks per training window")
    parser.add_argument("--markov-rank", type=int, default=256, help="the sequential head's rank (0: none)")
    parser.add_argument("--head", default="vanilla", choices=HEAD_TYPES, help="the sequential head")
    parser.add_argument(
        "--no-confidence", action="store_true", help="no confidence head (and no calibration)"
    )
    parser.add_argument("--decay", type=float, default=4.0, help="slot k weighted exp(-k/DECAY)")
    parser.add_argument("--ce-weight", type=float, default=0.1)
    parser.add_argument("--l1-weight", type=float, default=0.9)
    parser.add_argument("--confidence-weight", type=float, default=1.0)
    parser.add_argument("--calibration-seeds", type=int, default=8, help="rollouts per held-out prompt")
    parser.add_argument(
        "--calibration",
        choices=("scaling", "temperature"),
        default="scaling",
        help="scaling: a temperature and a shift per slot by the log-loss (removes a bias); "
        "temperature: the paper's temperature alone by the ECE",
    )
    parser.add_argument(
        "--recalibrate",
        metavar="DIR",
        help="only calibrate the shipped draft DIR again (its target: --target, else its eval.json's; "
        "its prompts, seeds and tokens: those of its calibration; --acceptance-prompts another count)",
    )
    parser.add_argument("--mask-token-id", type=int, help="the mask token (default as train_dflash.py's)")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        help="a draft vocabulary of the N most frequent training tokens (mtp-jax's d2t extension: the "
        "block's head is the target's columns for them, W2 covers them only; default: the whole one)",
    )
    parser.add_argument(
        "--no-frozen-copies",
        action="store_true",
        help="ship without DeepSpec's copies of the target's embedding and head (the loader checks them "
        "only when present; for a large vocabulary they are most of the file: SmolLM2's 135 -> 28 MB)",
    )
    args = parser.parse_args()
    if args.card:
        rewrite_card(args.card, card)
        return 0
    if args.recalibrate:
        if args.calibration_seeds < 1:
            parser.error("--calibration-seeds must be >= 1")
        return recalibrate(args.recalibrate, args)
    if args.layers < 1 or args.block_size < 2 or args.anchors < 1 or args.decay <= 0:
        parser.error("--layers and --anchors must be >= 1, --block-size >= 2, --decay > 0")
    if args.markov_rank < 0 or args.calibration_seeds < 1:
        parser.error("--markov-rank must be >= 0 and --calibration-seeds >= 1")
    if args.preset == "smoke":
        args.anchors, args.block_size = min(args.anchors, 4), min(args.block_size, 4)
        args.markov_rank, args.calibration_seeds = min(args.markov_rank, 8), min(args.calibration_seeds, 2)

    def check(cfg: ModelConfig, data: str) -> None:
        layer_ids = args.layer_ids or list(dflash_default_layers(cfg.num_hidden_layers, args.layers))
        if any(not -1 <= i < cfg.num_hidden_layers - 1 for i in layer_ids):
            parser.error(
                f"--layer-ids {layer_ids}: the target's layers run -1 (the embedding) .. "
                f"{cfg.num_hidden_layers - 2} (the last layer's output is not a feature)"
            )
        if args.seq <= args.block_size:
            parser.error(f"--seq {args.seq} is not longer than a block of {args.block_size}")
        if args.mask_token_id is None:
            args.mask_token_id = 0 if data in ("chat", "corpus") else PAD  # chat text never holds id 0
        if not 0 <= args.mask_token_id < cfg.vocab_size:
            parser.error(f"--mask-token-id {args.mask_token_id} is not a token id of the target")
        if args.draft_vocab is not None and not 1 <= args.draft_vocab <= cfg.vocab_size:
            parser.error(
                f"--draft-vocab {args.draft_vocab} must be in [1, {cfg.vocab_size}] (the target's vocabulary)"
            )

    run = start_run(args, parser, check)
    cfg, params = run.cfg, run.params
    layer_ids = args.layer_ids or list(dflash_default_layers(cfg.num_hidden_layers, args.layers))
    raw = draft_config(
        run.target_raw,
        cfg,
        args.layers,
        layer_ids,
        args.block_size,
        args.mask_token_id,
        args.markov_rank,
        args.head,
        not args.no_confidence,
        args.draft_vocab,
    )
    ids = None
    if "draft_vocab_size" in raw:  # the vocabulary a saved state was trained with, whatever the data says now
        vocab_file = os.path.join(run.workdir, "draft_vocabulary.npy")
        ids = np.load(vocab_file) if os.path.isfile(vocab_file) else None
        ids = draft_vocabulary([run.train_stream], cfg.vocab_size, args.draft_vocab) if ids is None else ids
        keep_vocabulary(vocab_file, ids)
    dcfg, tree = init_draft(raw, cfg, params, args.seed, ids)
    fixed = {k: tree.pop(k) for k in FIXED if k in tree}  # the vocabulary and the target's columns
    weights = LossWeights(args.ce_weight, args.l1_weight, args.confidence_weight, args.decay)
    n_params = sum(x.size for x in jax.tree.leaves(tree))
    optimizer = make_optimizer(args, tree)
    attach_target_cache(run, dcfg.capture, lambda hidden: dspark_features(dcfg, hidden), "layer outputs")

    @jax.jit
    def update(state: dict, batch: dict, anchors: jax.Array, target: dict) -> tuple[dict, dict]:
        cached = {k: v for k, v in batch.items() if k != "window"} or None

        def objective(t: dict) -> tuple[jax.Array, dict]:
            return draft_losses({**t, **fixed}, target, cfg, dcfg, batch["window"], anchors, weights, cached)

        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(state["draft"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["draft"])
        return {
            "draft": optax.apply_updates(state["draft"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }, aux

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        step = int(state["step"])  # a step's anchors come from (seed, step): a resumed run redraws them
        b, length = batch["window"].shape
        anchors = anchors_for(args.seed, step, b, args.anchors, length - 1, args.block_size)
        return update(state, batch, jnp.asarray(anchors), params)

    head = f"a {args.head} head of rank {args.markov_rank}" if args.markov_rank else "no sequential head"
    print(
        f"draft: DSpark for {cfg.model_type}, {args.layers} layers, {head}, "
        f"{'a confidence head' if dcfg.confidence_head else 'no confidence head'}, {n_params / 1e6:.2f}M "
        f"parameters, target layer outputs {layer_ids}, block {args.block_size}, {args.anchors} anchors a "
        f"window; {args.steps} steps x {args.batch} x {args.seq} tokens, own text {run.own}/{args.batch}",
        file=sys.stderr,
    )
    state = {"draft": tree, "opt_state": optimizer.init(tree), "step": jnp.zeros((), jnp.int32)}

    def export(st: dict) -> dict:
        return dspark_hub_tensors_from_params({**st["draft"], **fixed}, dcfg, params, ml_dtypes.bfloat16)

    def load(reader: CheckpointReader, raw: dict) -> dict:
        loaded = load_dspark(reader, raw, cfg, jnp.float32, strict=True, verbose=False, target_params=params)[
            1
        ]
        for key in FIXED:  # the partial's vocabulary, whatever this run's data would choose
            if key in loaded:
                fixed[key] = loaded.pop(key)
        if "draft_to_target" in fixed:
            keep_vocabulary(
                os.path.join(run.workdir, "draft_vocabulary.npy"), np.asarray(fixed["draft_to_target"])
            )
        return loaded

    def export_partial(st: dict) -> dict:  # without the target's frozen copies: the loader checks them only
        return {k: v for k, v in export(st).items() if k not in FROZEN}

    done = run_training(run, state, train_step, "dspark", raw=raw, export=export_partial, load=load)
    if done is None:
        return 0
    state, start, seconds = done
    tensors = (export_partial if args.no_frozen_copies else export)(state)
    held = evaluate(
        {**bf16_rounded(state["draft"]), **fixed},
        params,
        cfg,
        dcfg,
        run.held_stream,
        run.length,
        args.eval_windows,
        args.anchors,
        weights,
    )
    calibration = None
    if dcfg.confidence_head:
        new_tokens = 16 if args.preset == "smoke" else CALIBRATION_TOKENS
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "uncalibrated")
            write_hub_checkpoint(path, raw, tensors)
            prompts = run.prompt_ids(args.acceptance_prompts)
            fields, calibration = calibrate(
                args.target,
                path,
                prompts,
                raw["block_size"],
                args.calibration_seeds,
                new_tokens,
                args.calibration,
            )
        raw = {**raw, **fields}
    draft = {
        "layers": args.layers,
        "layer_ids": layer_ids,
        "block_size": args.block_size,
        "markov_rank": args.markov_rank,
        "head": args.head,
        "confidence_head": dcfg.confidence_head,
        "draft_vocab_size": dcfg.draft_vocab_size or cfg.vocab_size,
        "parameters": int(n_params),
        "frozen_copies": not args.no_frozen_copies,
    }
    training = {"anchors": args.anchors, "loss_weights": dataclasses.asdict(weights)}
    report = report_for(run, draft, training, held, start, seconds)
    if calibration is not None:
        report["calibration"] = calibration
    ship(run, raw, tensors, report, "dspark", card)
    return 0


def card(raw: dict, r: dict) -> str:
    d, t, h, dr = r["data"], r["training"], r["heldout"], r["draft"]
    note = f" ({t['note']})" if t.get("note") else ""
    slots = " / ".join(str(j + 1) for j in range(len(h["level_agreement"])))
    agree = " / ".join(f"{a:.3f}" for a in h["level_agreement"])
    accept = " / ".join(f"{a:.3f}" for a in h["level_acceptance"])
    acc, mtp = r.get("acceptance", {}), r.get("mtp_acceptance", {})
    lines = "\n".join(f"| {k} | {v:.2f} | {f'{mtp[k]:.2f}' if k in mtp else '-'} |" for k, v in acc.items())
    w = t["loss_weights"]
    head = (
        f"a {dr['head']} Markov head of rank {dr['markov_rank']} (the previous token's bias on each slot's "
        "logits)"
        if dr["markov_rank"]
        else "no sequential head"
    )
    if dr.get("draft_vocab_size", raw["vocab_size"]) < raw["vocab_size"]:
        head += (
            f", over a draft vocabulary of the {dr['draft_vocab_size']:,} most frequent training tokens "
            "(`d2t`; the block's head is the target's columns for them)"
        )
    copies = (
        ", and copied into the checkpoint as DeepSpec's layout has them"
        if dr.get("frozen_copies", True)
        else "; DeepSpec's layout stores frozen copies of them, left out of this shipped checkpoint to "
        "keep it small, as the loader checks them only when present"
    )
    calibration = "No confidence head."
    c = r.get("calibration")
    if c is not None:
        calibration = calibration_section(c)
    return f"""# DSpark draft for `{r["target"]}`

A DSpark draft for the `{r["target"]}` target of mtp-jax, written by `scripts/train_dspark.py`:
{dr["layers"]} Qwen3-style decoder layers ({raw["num_attention_heads"]} heads, {raw["num_key_value_heads"]} KV
heads, q/k norms) over target layer outputs {dr["layer_ids"]} (-1: the embedding), run once over
`[anchor, MASK x {dr["block_size"] - 1}]`; every slot's logits are the target's head plus {head},
sampled left to right, so one forward proposes up to {dr["block_size"]} drafts;
{"a confidence head" if dr["confidence_head"] else "no confidence head"}. {dr["parameters"] / 1e6:.2f}M
parameters of its own (the target's embedding and head are used{copies}).
DeepSpec's layout (`Qwen3DSparkModel`), bf16.

{usage_line(r, "dspark")}

## Training
{data_sentence(d)} {t["steps"]} steps of {t["batch"]} x {t["seq"]} tokens, AdamW (lr {t["lr"]},
warm-up {t["warmup"]}, cosine decay), seed {t["seed"]}; {t["anchors"]} random anchors per window, each
block over the context before its anchor and bidirectional within itself, teacher-forced heads;
per slot {w["ce"]:g} x cross-entropy + {w["l1"]:g} x L1 distance to the target's distribution +
{w["confidence"]:g} x the confidence BCE against sum(min(p_draft, p_target)), slot k weighted
exp(-k/{w["decay"]:g}){own_text_clause(d, t)}. The target is frozen.
{t["batch"] * t["seq"] * t["steps"]:,} tokens trained.
{t["seconds"] / 60:.1f} minutes on {t["machine"]}{note}. The command (resumable):

    {t["command"]}

## Held-out results (the shipped bf16 weights)
| block slot | {slots} |
|---|---|
| agreement with the target's greedy token | {agree} |
| analytic acceptance sum(min(p_draft, p_target)), teacher-forced | {accept} |

Greedy acceptance length (tokens per step; {acceptance_setup(r)}):

| K | DSpark | the target's own MTP |
|---|---|---|
{lines}

## Calibration
{calibration}

Speed against plain decoding and the other drafts is in the repository's BENCHMARKS.md.
"""


def calibration_section(c: dict) -> str:
    """The card's calibration paragraph and table from eval.json's "calibration"."""
    hh, hu, hp = c["heldout"], c["heldout_uncalibrated"], c.get("heldout_temperature_only")
    scaling = c.get("method", "temperature") == "scaling"
    columns = [("uncalibrated", hu)] + ([("temperature alone (the paper's)", hp)] if hp else [])
    columns.append(("calibrated", hh))

    def row(name: str, cell) -> str:
        return f"| {name} | " + " | ".join(cell(x) for _, x in columns) + " |"

    fitted = "Temperatures per slot: " + ", ".join(f"{x:g}" for x in c["temperatures"])
    if scaling:
        fitted += "; shifts: " + ", ".join(f"{x:g}" for x in c["shifts"])
    how = (
        "A temperature and a shift per slot, sigmoid(z / T + s), fitted left to right by the log-loss\n"
        "of the cumulative confidence (mtp-jax's extension of the paper's sequential temperature\n"
        "scaling: a temperature alone cannot remove a bias)"
        if scaling
        else "Sequential temperature scaling (the paper's: one temperature per slot by the ECE of the\n"
        "cumulative confidence)"
    )
    return "\n".join(
        [
            f"""{how}.
On speculative-sampling rollouts (temperature 1, the whole block, {c["seeds_per_prompt"]} seeds x
{c["new_tokens"]} new tokens per prompt): fitted on {c["fit"]["prompts"]} held-out prompts
({c["fit"]["steps"]} steps), measured on the other {hh["prompts"]} ({hh["steps"]} steps).
{fitted}.
""",
            "| on the measuring prompts | " + " | ".join(name for name, _ in columns) + " |",
            "|---" * (len(columns) + 1) + "|",
            row(
                "ECE of the cumulative confidence, per slot",
                lambda x: " / ".join(f"{e:.3f}" for e in x["ece_per_slot"]),
            ),
            row(
                f"expected accepted drafts per step (observed {hh['observed_accepted_per_step']:.3f})",
                lambda x: f"{x['expected_accepted_per_step']:.3f}",
            ),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
