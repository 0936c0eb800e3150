"""A draft-training run against a frozen target, shared by the EAGLE-3, DFlash and DSpark training
scripts: the command-line arguments they all take (:func:`add_run_arguments`), loading the target
and its data (its standard-library split, or its own chat replies: :mod:`mtp_jax.train.distill`),
each step's batch (optionally read from a :mod:`mtp_jax.train.target_cache`), the resumable loop
with partial exports that carry a run across machines (:func:`run_training`), and shipping the
draft with its measured greedy acceptance, eval.json and card, atomically (:func:`ship`)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tokenizers import Tokenizer

from mtp_jax.checkpoint.formats import checkpoint_format
from mtp_jax.checkpoint.safetensors_io import CheckpointReader, write_hub_checkpoint
from mtp_jax.config import ModelConfig, parse_config
from mtp_jax.embedded import resolve_model_path
from mtp_jax.model import load, read_model_config
from mtp_jax.targets import target_for
from mtp_jax.targets.base import Hidden, lm_head
from mtp_jax.train import distill, shards, target_cache
from mtp_jax.train.cards import ACCEPTANCE_TOKENS, report_command
from mtp_jax.train.data import (
    BOS,
    SourceWindows,
    continuations_path,
    data_report,
    load_or_make_continuations,
    read_text,
    stdlib_modules,
    token_stream,
    window_starts,
)
from mtp_jax.train.loop import run_report, train_loop, training_window, with_step_count


def load_params(path: str, cfg: ModelConfig) -> dict:
    """The checkpoint at ``path`` as float32 parameters, read strictly."""
    return checkpoint_format(cfg).load_params(CheckpointReader(path), cfg, jnp.float32, strict=True)


def draft_vocabulary(streams: list[np.ndarray], vocab_size: int, size: int) -> np.ndarray:
    """The ``size`` most frequent token ids of the training data (ties: lower id first), ascending:
    draft id j is target id ids[j] (d2t[j] = ids[j] - j)."""
    counts = sum(np.bincount(s.ravel(), minlength=vocab_size) for s in streams)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:size]).astype(np.int32)


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the training text comes from: stdlib, the target's chat replies, or its corpus."""
    parser.add_argument(
        "--data",
        default="auto",
        choices=["auto", "stdlib", "chat", "corpus"],
        help="stdlib: the standard-library text the tiny targets were trained on; chat: the target's own "
        "replies to chat and code prompts (scripts/distill.py); corpus: a self-distillation corpus of "
        "the target (--corpus, scripts/build_corpus.py); auto: stdlib for a target trained here (it "
        "has eval.json), chat otherwise",
    )
    parser.add_argument(
        "--corpus",
        metavar="DIR",
        help="corpus data: the corpus directory (default: training/corpus-TARGET); a run reads the shards "
        "finished when it started, and a resumed run the same ones",
    )
    parser.add_argument(
        "--corpus-heldout",
        type=float,
        default=shards.HELDOUT_FRACTION,
        metavar="FRACTION",
        help="corpus data: the share of conversations held out, chosen by a hash of their id",
    )
    parser.add_argument(
        "--source-weights",
        type=source_weights,
        metavar="NAME=W,...",
        help="corpus data: draw each window's source in these shares, e.g. chat=2,math=1,code=1 "
        "(default: in proportion to each source's tokens)",
    )
    parser.add_argument("--reply-tokens", type=int, default=160, help="chat data: longest target reply")
    parser.add_argument(
        "--max-prompts", type=int, help="chat data: train on the first N prompts (a fair sample) only"
    )
    parser.add_argument(
        "--replies-dir",
        help="chat data: where the target's replies are kept (default: beside --workdir; commit it to "
        "carry them to another machine)",
    )


def source_weights(text: str) -> dict[str, float]:
    """``--source-weights`` as {source: weight}: NAME=W pairs joined by commas."""
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected NAME=WEIGHT,... (e.g. chat=2,code=1), got {text!r}"
            ) from None
    return out


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every draft-training script against a frozen target takes."""
    parser.add_argument(
        "--target",
        help="the frozen target: a checkpoint directory trained here, or a real model (directory or .gguf); "
        "required unless --card",
    )
    _add_data_arguments(parser)
    parser.add_argument("--partial", help="where --export-every writes the draft (default: OUT.partial)")
    parser.add_argument("--eval-prompts", type=int, default=16, help="chat data: held-out prompts per kind")
    parser.add_argument("--out", help="draft directory to write (must not exist)")
    parser.add_argument(
        "--card", metavar="DIR", help="only rewrite DIR/README.md from its config.json and eval.json"
    )
    parser.add_argument("--workdir", help="orbax training state, for resuming (default: OUT.train)")
    parser.add_argument("--preset", default="default", choices=["default", "smoke"])
    parser.add_argument("--own-text", type=float, default=0.5, metavar="FRACTION")
    parser.add_argument("--own-text-windows", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument(
        "--export-every",
        type=int,
        default=0,
        help="write the draft to OUT.partial every N steps (at a save); a run without the orbax state "
        "starts from it (commit it to resume on another machine)",
    )
    parser.add_argument("--max-files", type=int, help="use only the first N modules (smoke tests)")
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument(
        "--stop-after", type=int, help="stop after this many steps in this run (rerun to resume)"
    )
    parser.add_argument("--acceptance-k", type=int, nargs="*", default=[1, 2, 3, 4, 5])
    parser.add_argument(
        "--acceptance-prompts",
        type=int,
        help="measure acceptance on the first N held-out prompts only (default: all; smoke: 8)",
    )
    parser.add_argument(
        "--acceptance-tokens", type=int, help="new tokens per prompt for acceptance (default 64; smoke: 16)"
    )
    parser.add_argument(
        "--target-cache",
        metavar="DIR",
        help="compute the frozen target's features and top --cache-k next-token log-probabilities once "
        "per training token into DIR (mtp_jax.train.target_cache; resumable) and train from them instead of "
        "running the target every step",
    )
    parser.add_argument(
        "--cache-k", type=int, default=32, help="teacher tokens kept per position in the cache"
    )
    parser.add_argument(
        "--cache-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="cached features' precision",
    )


@dataclasses.dataclass
class Run:
    """A draft-training run against a frozen target: its arguments, the target, the data."""

    args: argparse.Namespace
    workdir: str
    own: int
    target_raw: dict
    cfg: ModelConfig
    params: dict
    tok: Tokenizer
    target_eval: dict
    train_files: list[str]
    held_files: list[str]
    train_stream: np.ndarray
    held_stream: np.ndarray
    start: float = dataclasses.field(default_factory=time.perf_counter)
    own_windows: np.ndarray | None = None
    held_prompts: list[list[int]] | None = None
    """The held-out prompts as token ids (corpus data: first turns as the corpus rendered them)."""
    data: dict = dataclasses.field(default_factory=dict)
    """eval.json's account of the data (chat data; stdlib data is described by its module split)."""
    train_starts: np.ndarray | None = None
    """Where each conversation starts in the train stream (chat data; None: one text)."""
    cache: Any = None
    """The target cache (:class:`target_cache.TargetCache`) when ``--target-cache`` is given."""
    sources: SourceWindows | None = None
    """Windows drawn source by source (corpus data with ``--source-weights``; None: uniformly)."""

    def batch(self, step: int) -> dict:
        """Step ``step``'s batch: its windows [b, seq + 1] and, with a target cache, the cached rows
        of their first seq tokens (features, top_ids, top_logp)."""
        args, starts = self.args, self.window_offsets(step)
        own = self.own_windows if self.own else None
        window = training_window(args, self.train_stream, own, step, starts if self.sources else None)
        out = {"window": jnp.asarray(window)}
        if self.cache is not None:
            out.update({k: jnp.asarray(v) for k, v in self.cache.rows(starts, args.seq).items()})
        return out

    def window_offsets(self, step: int) -> np.ndarray:
        """Where step ``step``'s windows start in the training stream: drawn from (seed, step),
        uniformly or (``sources``) source by source."""
        args, size = self.args, len(self.train_stream)
        if self.sources is not None:
            return self.sources.offsets(size, args.seed, step, args.batch, args.seq + 1)
        return window_starts(size, args.seed, step, args.batch, args.seq + 1)

    def encode_prompt(self, text: str) -> list[int]:
        """A held-out prompt as the target sees it: BOS + text (stdlib), or the chat-rendered user turn."""
        if self.data.get("kind") == "chat":
            return self.tok.encode_chat([{"role": "user", "content": text}])
        return [BOS, *self.tok.encode(text, add_special_tokens=False).ids]

    def prompt_ids(self, n: int | None = None) -> list[list[int]]:
        """The first ``n`` (default: all) held-out prompts as the target sees them."""
        if self.held_prompts is not None:
            return self.held_prompts[:n]
        return [self.encode_prompt(t) for t in self.target_eval.get("prompts", [])[:n]]

    @property
    def length(self) -> int:
        return self.args.seq + 1


def _check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, int]:
    """The shared arguments checked (``parser.error`` names a bad one) and completed (the smoke
    preset, the resolved target path): (the data kind, own-text windows per batch)."""
    if not args.target:
        parser.error("--target is required")
    if not args.out:
        parser.error("--out is required")
    if os.path.exists(args.out):
        parser.error(f"--out {args.out} already exists; choose a new directory")
    args.target_name = args.target  # a packaged model's name, or the path given
    try:
        args.target = resolve_model_path(args.target)
    except FileNotFoundError as e:
        parser.error(f"--target: {e}")
    if not os.path.exists(args.target):
        parser.error(f"--target {args.target} does not exist")
    trained_here = os.path.isfile(os.path.join(args.target, "eval.json"))
    data = args.data if args.data != "auto" else ("stdlib" if trained_here else "chat")
    if data == "stdlib":
        for name in ("config.json", "tokenizer.json", "eval.json"):
            if not os.path.isfile(os.path.join(args.target, name)):
                parser.error(f"--target {args.target} is not a checkpoint trained here (no {name})")
    elif os.path.isdir(args.target) and not all(
        os.path.isfile(os.path.join(args.target, n)) for n in ("config.json", "tokenizer.json")
    ):
        parser.error(
            f"--target {args.target} is not a checkpoint: neither one trained here (config.json, "
            "tokenizer.json, eval.json) nor a real model (a .gguf file, or config.json and tokenizer.json)"
        )
    if not 0.0 <= args.own_text <= 1.0:
        parser.error(f"--own-text is a fraction in [0, 1], got {args.own_text}")
    if data in ("chat", "corpus"):
        args.own_text = 0.0  # the data already is the target's own text
    if not 0.0 < args.corpus_heldout < 1.0:
        parser.error(f"--corpus-heldout is a fraction in (0, 1), got {args.corpus_heldout}")
    if args.source_weights is not None and data != "corpus":
        parser.error(f"--source-weights weighs a corpus's sources: it needs --data corpus, not {data}")
    if args.preset == "smoke":  # a few seconds end to end
        args.max_files, args.batch, args.seq = args.max_files or 8, 2, 32
        args.own_text_windows, args.eval_windows = min(args.own_text_windows, 2), min(args.eval_windows, 4)
        args.reply_tokens, args.eval_prompts = min(args.reply_tokens, 8), min(args.eval_prompts, 2)
        args.acceptance_prompts = 8 if args.acceptance_prompts is None else args.acceptance_prompts
        args.acceptance_tokens = 16 if args.acceptance_tokens is None else args.acceptance_tokens
    if args.acceptance_tokens is None:
        args.acceptance_tokens = ACCEPTANCE_TOKENS
    if args.acceptance_tokens < 1 or (args.acceptance_prompts is not None and args.acceptance_prompts < 1):
        parser.error("--acceptance-prompts and --acceptance-tokens must be at least 1")
    own = round(args.own_text * args.batch)
    if args.own_text and own == 0:
        parser.error(f"--own-text {args.own_text} of a batch of {args.batch} is not one window")
    if args.target_cache and own:
        parser.error(
            "--target-cache holds the training stream's rows, not --own-text windows: add --own-text 0"
        )
    if args.cache_k < 1:
        parser.error(f"--cache-k must be at least 1, got {args.cache_k}")
    return data, own


def start_run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    check: Callable[[ModelConfig, str], None] | None = None,
) -> Run:
    """Check the shared arguments (the smoke preset shrinks everything to seconds), load the frozen
    target and the data: the split it was trained on (stdlib), or its own replies (chat).
    ``check(cfg, data)`` checks the script's own arguments against the target's config before
    anything is loaded (a bad argument fails in a second)."""
    data, own = _check_arguments(args, parser)
    workdir = os.path.abspath(args.workdir or args.out.rstrip("/") + ".train")
    t0 = time.perf_counter()
    target_raw = read_model_config(args.target)
    cfg = parse_config(target_raw)
    if check is not None:
        check(cfg, data)
    if data == "chat":
        return start_chat_run(args, workdir, t0, target_raw)
    if data == "corpus":
        return start_corpus_run(args, workdir, t0, target_raw)
    params = load_params(args.target, cfg)
    tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    with open(os.path.join(args.target, "eval.json"), encoding="utf-8") as f:
        target_eval = json.load(f)
    root, train_files, held_files = stdlib_modules(args.max_files)
    train_stream = token_stream(tok, [read_text(root, p) for p in train_files])
    held_stream = token_stream(tok, [read_text(root, p) for p in held_files])
    print(
        f"data: {len(train_files)} train / {len(held_files)} held-out modules; {len(train_stream):,} train / "
        f"{len(held_stream):,} held-out tokens ({time.perf_counter() - t0:.0f}s)",
        file=sys.stderr,
    )
    return Run(
        args,
        workdir,
        own,
        target_raw,
        cfg,
        params,
        tok,
        target_eval,
        train_files,
        held_files,
        train_stream,
        held_stream,
        start=t0,
    )


def start_chat_run(args: argparse.Namespace, workdir: str, t0: float, target_raw: dict) -> Run:
    """A real chat model as the target: its own greedy replies to the prompts of
    :mod:`mtp_jax.train.distill` (generated once through mtp-jax, kept beside the training state)."""
    model = load(args.target, "float32", layer_buffers=False)
    codec = model.text
    if codec.chat_template is None:
        raise SystemExit(f"--target {args.target} has no chat template: chat data needs one")
    train, held = distill.build_prompts(args.max_files)
    train = train[: args.max_prompts]
    if not train or not held:
        raise SystemExit(
            f"chat data: {len(train)} training and {len(held)} held-out prompts from --max-files "
            f"{args.max_files}; both need some (give more files)"
        )
    evaluation = distill.heldout_prompts(args.eval_prompts, args.max_files)
    streams = []
    for name, prompts in (("train", train), ("heldout", held)):
        path = distill.replies_path(
            args.replies_dir or os.path.dirname(workdir), args.target_name, name, args.reply_tokens
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        replies = distill.generate_replies(model, codec, prompts, path, args.reply_tokens)
        streams.append(distill.conversation_stream(codec, prompts, replies))
    (train_stream, train_starts), (held_stream, _) = streams
    print(
        f"data: {len(train)} train / {len(held)} held-out prompts; {len(train_stream):,} train / "
        f"{len(held_stream):,} held-out tokens ({time.perf_counter() - t0:.0f}s)",
        file=sys.stderr,
    )
    data = {
        "kind": "chat",
        "source": distill.SOURCE.format(version=platform.python_version()),
        "replies": f"the target's greedy replies, at most {args.reply_tokens} tokens, through mtp-jax",
        "train_prompts": len(train),
        "heldout_prompts": len(held),
        "train_tokens": int(len(train_stream)),
        "heldout_tokens": int(len(held_stream)),
    }
    run = _model_run(args, workdir, target_raw, model, (train_stream, held_stream), start=t0, data=data)
    run.target_eval, run.train_starts = {"prompts": [p["text"] for p in evaluation]}, train_starts
    return run


def _model_run(
    args: argparse.Namespace, workdir: str, target_raw: dict, model: Any, streams: tuple, **fields: Any
) -> Run:
    """A run on a loaded real model's own text (chat replies or a corpus): its codec, no stdlib
    module split, nothing of its own text mixed in (the data already is)."""
    train, held = streams
    return Run(
        args,
        workdir,
        0,
        target_raw,
        model.config,
        model.params,
        model.text,
        {},
        [],
        [],
        train,
        held,
        **fields,
    )


def _corpus_split(args: argparse.Namespace, workdir: str, model: Any) -> tuple[str, dict, shards.CorpusSplit]:
    """(the corpus directory, its manifest, its split) for ``--data corpus``, checked against the
    target; the shards read are pinned in the workdir so that a resumed run sees the same data."""
    name = os.path.basename(os.path.normpath(args.target_name)).removesuffix(".gguf")
    directory = args.corpus or os.path.join("training", f"corpus-{name}")
    try:
        manifest = shards.read_manifest(directory)
    except FileNotFoundError as e:
        raise SystemExit(f"--corpus: {e}") from None
    ident = manifest.get("identity", {})
    if ident.get("target") != name or ident.get("vocab_size") != model.config.vocab_size:
        raise SystemExit(
            f"--corpus {directory} holds the text of {ident.get('target')!r} (vocabulary "
            f"{ident.get('vocab_size')}), not of the target {name!r} (vocabulary {model.config.vocab_size}): "
            "a draft learns its own target's text"
        )
    pinned = os.path.join(workdir, "corpus-shards.json")
    names = None
    if os.path.isfile(pinned):
        with open(pinned, encoding="utf-8") as f:
            names = json.load(f)
    try:
        split = shards.split_corpus(directory, args.corpus_heldout, names)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--corpus: {e}") from None
    os.makedirs(workdir, exist_ok=True)
    shards.write_json(pinned, split.shards)
    return directory, manifest, split


def start_corpus_run(args: argparse.Namespace, workdir: str, t0: float, target_raw: dict) -> Run:
    """A target's own self-distillation corpus (:mod:`mtp_jax.train.regenerate`): its training
    conversations as the stream, held-out ones (a hash of the id) for evaluation, their first turns,
    the sources in turn, ``--eval-prompts`` per source, as the acceptance prompts."""
    model = load(args.target, "float32", layer_buffers=False)
    directory, manifest, split = _corpus_split(args, workdir, model)
    taken: dict[str, int] = {}
    prompts = []
    for ids, source in zip(split.held_prompts, split.held_sources, strict=True):
        if taken.get(source, 0) < args.eval_prompts:
            taken[source] = taken.get(source, 0) + 1
            prompts.append(ids)

    def total(side: str, key: str) -> int:
        return sum(row[key] for row in split.counts[side].values())

    print(
        f"data: corpus {directory}, {len(split.shards)} shards; {total('train', 'conversations')} train / "
        f"{total('heldout', 'conversations')} held-out conversations; {len(split.train_stream):,} train / "
        f"{len(split.held_stream):,} held-out tokens; {len(prompts)} acceptance prompts "
        f"({time.perf_counter() - t0:.0f}s)",
        file=sys.stderr,
    )
    ident = manifest.get("identity", {})
    data = {
        "kind": "corpus",
        "corpus": directory,
        "shards": len(split.shards),
        "heldout_fraction": args.corpus_heldout,
        "sampling": ident.get("settings", {}),
        "train_conversations": total("train", "conversations"),
        "heldout_conversations": total("heldout", "conversations"),
        "train_tokens": int(len(split.train_stream)),
        "train_reply_tokens": total("train", "reply_tokens"),
        "heldout_tokens": int(len(split.held_stream)),
        "by_source": split.counts,
        "acceptance_sources": dict(sorted(taken.items())),
        "chat_template": bool(ident.get("chat_template", True)),  # False: a base model's completions
    }
    run = _model_run(
        args, workdir, target_raw, model, (split.train_stream, split.held_stream),
        start=t0, held_prompts=prompts, data=data, train_starts=split.train_starts,
    )  # fmt: skip
    if args.source_weights is not None:
        try:
            run.sources = SourceWindows(
                split.train_starts, split.train_sources, len(split.train_stream), args.source_weights
            )
        except ValueError as e:
            raise SystemExit(f"--source-weights: {e}") from None
        data["source_weights"] = dict(
            zip(run.sources.names, run.sources.shares.round(4).tolist(), strict=True)
        )
    run.target_eval = {"prompts": [model.text.decode(p, skip_special_tokens=False) for p in prompts]}
    return run


def attach_target_cache(
    run: Run, capture: tuple[int, ...], features: Callable[[Hidden], jax.Array], kind: str
) -> None:
    """With ``--target-cache DIR``: build (or finish, or open) the cache of the target's
    ``features(hidden)`` over the training stream, one conversation per context, and make every
    step read it (:meth:`Run.batch`). ``kind`` names what the features are, not which draft reads
    them: drafts whose features are the same (DFlash and DSpark, unless DFlash captures the last
    layer, which it reads final-normed) share one cache."""
    args = run.args
    if not args.target_cache:
        return
    cfg, target = run.cfg, target_for(run.cfg)

    def forward(params: dict, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _ = target.forward(params, cfg, tokens, positions, capture=capture)
        return features(hidden), jax.nn.log_softmax(lm_head(params, hidden.post_norm).astype(jnp.float32), -1)

    probe = jax.eval_shape(forward, run.params, jax.ShapeDtypeStruct((1, 2), jnp.int32))
    config_digest = hashlib.sha256(json.dumps(run.target_raw, sort_keys=True).encode()).hexdigest()[:16]
    identity = {
        "target": os.path.basename(os.path.normpath(args.target_name)),
        "target_config": config_digest,
        "features": f"{kind}, captured layers {list(capture)}",
    }
    print(f"target cache: {args.target_cache} ({kind} features, top {args.cache_k})", file=sys.stderr)
    run.cache = target_cache.build(
        args.target_cache,
        forward=forward,
        params=run.params,
        stream=run.train_stream,
        starts=run.train_starts,
        identity=identity,
        feature_size=probe[0].shape[-1],
        k=args.cache_k,
        feature_dtype=args.cache_dtype,
    )


def keep_vocabulary(path: str, ids: np.ndarray) -> None:
    """Keep the draft vocabulary beside the training state (a resumed run trains the same head
    rows even when its data would now choose others)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp-write.npy"
    np.save(tmp, np.asarray(ids, np.int32))
    os.replace(tmp, path)


def own_text(run: Run) -> np.ndarray | None:
    """The target's own continuations (made once, kept beside the training state), when asked for."""
    if run.own and run.own_windows is None:
        run.own_windows = load_or_make_continuations(
            run.workdir,
            run.cfg,
            run.params,
            run.train_stream,
            run.args.own_text_windows,
            run.length,
            run.args.seed,
        )
    return run.own_windows


def partial_dir(args: argparse.Namespace) -> str:
    return args.partial or args.out.rstrip("/") + ".partial"


def _from_partial(
    partial: str,
    state: dict,
    raw: dict,
    load: Callable[[CheckpointReader, dict], dict],
    may_differ: tuple[str, ...],
) -> tuple[dict, int] | None:
    """The training state started from a partial export (its draft, a fresh optimizer whose
    schedule goes on from its step), or None when there is none; a partial of another
    configuration is refused by name."""
    if not os.path.isfile(os.path.join(partial, "progress.json")):
        return None
    with open(os.path.join(partial, "config.json"), encoding="utf-8") as f:
        written = json.load(f)
    if {k: v for k, v in written.items() if k not in may_differ} != {
        k: v for k, v in raw.items() if k not in may_differ
    }:
        raise SystemExit(f"{partial} holds a draft of another configuration; move it away to start afresh")
    with open(os.path.join(partial, "progress.json"), encoding="utf-8") as f:
        step = int(json.load(f)["step"])
    state = {**state, "draft": load(CheckpointReader(partial), raw)}
    state["opt_state"] = with_step_count(state["opt_state"], step)
    if "step" in state:
        state["step"] = jnp.asarray(step, state["step"].dtype)
    print(f"starting from the draft at step {step} in {partial} (fresh optimizer moments)", file=sys.stderr)
    return state, step


def run_training(
    run: Run,
    state: dict,
    train_step,
    name: str,
    raw: dict | None = None,
    export: Callable[[dict], dict] | None = None,
    load: Callable[[CheckpointReader, dict], dict] | None = None,
    may_differ: tuple[str, ...] = (),
) -> tuple[dict, int, float] | None:
    """:func:`mtp_jax.train.loop.train_loop` on the run's data: (state, first step of this run, seconds), or
    None when stopped early.

    ``may_differ``: config.json keys a run may change from its partial's (DFlash's draft
    vocabulary: its head is the target's, not trained); any other difference is refused.

    With ``--export-every N``, every N steps the draft (``export(state)``: its hub tensors, bf16) is
    written to ``OUT.partial`` with the step reached; a run on a machine without the orbax state
    (``--workdir``) starts from there (``load(reader, raw)``: the draft tree) with a fresh optimizer
    whose schedule goes on from that step. Commit ``OUT.partial`` to carry a long run across
    machines."""
    args = run.args

    exported = [0]

    def on_save(st: dict, step: int) -> None:  # the first save at or past each multiple of N, and the last
        due = args.export_every and (step // args.export_every > exported[0] // args.export_every)
        if export is None or not (due or (args.export_every and step == args.steps)):
            return
        exported[0] = step
        partial = partial_dir(args)
        progress = {"step": step, "steps": args.steps, "command": report_command()}
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(partial))) as tmp:
            path = os.path.join(tmp, "partial")
            path_json = os.path.join(tmp, "progress.json")
            with open(path_json, "w", encoding="utf-8") as f:
                json.dump(progress, f, indent=2)
            write_hub_checkpoint(path, raw, export(st), extra_files={"progress.json": path_json})
            old = os.path.join(tmp, "previous")
            if os.path.isdir(partial):  # a kill between the renames leaves it whole in tmp*/previous
                os.replace(partial, old)
            os.replace(path, partial)
        print(f"draft at step {step} written to {partial}", file=sys.stderr)

    def warm(st: dict) -> tuple[dict, int] | None:
        found = None if load is None else _from_partial(partial_dir(args), st, raw, load, may_differ)
        if found is not None:
            exported[0] = found[1]
        return found

    done = train_loop(
        args,
        run.workdir,
        state,
        train_step,
        run.train_stream,
        own_text(run),
        name=name,
        warm=warm,
        on_save=on_save,
        batch_for=run.batch,
    )
    if done is None:
        return None
    state, _, start, seconds = done
    return state, start, seconds


def report_for(run: Run, draft: dict, training: dict, heldout: dict, start: int, seconds: float) -> dict:
    """eval.json of a draft: the target, the draft, the data, the run (with its exact command)."""
    args = run.args
    return {
        "target": os.path.basename(os.path.normpath(args.target_name)),
        "target_path": args.target_name,
        "name": os.path.basename(os.path.normpath(args.out)),
        "draft": draft,
        "data": run.data or data_report(run.train_files, run.held_files, run.train_stream, run.held_stream),
        "training": {
            **run_report(args),
            **training,
            "own_text": args.own_text,
            "own_text_windows": args.own_text_windows if run.own else 0,
            "seconds": round(seconds, 1),
            "resumed_from": start,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__}",
            "command": report_command(),
        },
        "heldout": heldout,
        "prompts": run.target_eval.get("prompts", []),
    }


def ship(run: Run, raw: dict, tensors: dict, report: dict, method: str, render) -> None:
    """Measure greedy acceptance through the public API on the written draft, then write it with
    eval.json and its card (``render(raw, report)``) atomically; clean the training state up."""
    args = run.args
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        staged = os.path.join(tmp, "draft")
        write_hub_checkpoint(staged, raw, tensors)
        prompts = report["prompts"][: args.acceptance_prompts]
        report["acceptance"] = acceptance_lengths(
            args.target,
            staged,
            run.prompt_ids(args.acceptance_prompts),
            args.acceptance_k,
            method,
            args.acceptance_tokens,
        )
        setup = {"prompts": len(prompts), "new_tokens": args.acceptance_tokens}
        if setup != {"prompts": len(report["prompts"]), "new_tokens": ACCEPTANCE_TOKENS}:
            report["acceptance_setup"] = setup  # fewer prompts or tokens than the target's own eval
        elif "acceptance" in run.target_eval:
            report["mtp_acceptance"] = run.target_eval["acceptance"]  # the target's own MTP, same prompts
        for name, text in (
            ("eval.json", json.dumps(report, indent=2) + "\n"),
            ("README.md", render(raw, report)),
        ):
            files[name] = os.path.join(tmp, name)
            with open(files[name], "w", encoding="utf-8") as f:
                f.write(text)
        write_hub_checkpoint(args.out, raw, tensors, extra_files=files)
    print(f"wrote {args.out} ({time.perf_counter() - run.start:.0f}s in all)", file=sys.stderr)
    shutil.rmtree(run.workdir, ignore_errors=True)
    shutil.rmtree(partial_dir(args), ignore_errors=True)
    if run.own:
        os.remove(continuations_path(run.workdir, args.own_text_windows, run.length, args.seed))


def bf16_rounded(tree: dict) -> dict:
    """The float leaves as the shipped bf16 weights hold them (in float32): what eval.json measures."""
    return jax.tree.map(
        lambda x: (
            x
            if jnp.issubdtype(x.dtype, jnp.integer)
            else jnp.asarray(np.asarray(x, ml_dtypes.bfloat16), jnp.float32)
        ),
        tree,
    )


def acceptance_lengths(
    target: str,
    draft: str,
    ids: list[list[int]],
    ks: list[int],
    method: str = "eagle3",
    new_tokens: int = ACCEPTANCE_TOKENS,
) -> dict:
    """Greedy acceptance length of K drafts over the held-out prompts (token ids; ``new_tokens``
    each), through the public API: the written draft loaded beside the target."""
    if not ks or not ids:
        return {}
    return acceptance_by_k(load(target, "float32", draft_model=draft), ids, ks, method, new_tokens)


def acceptance_by_k(model, ids: list[list[int]], ks: list[int], method: str, new_tokens: int) -> dict:
    """{str(K): greedy acceptance length} of ``model`` drafting with ``method`` over ``ids``."""
    out = {}
    for k in ks:
        result = model.generate(
            ids, max_new_tokens=new_tokens, draft=method, num_speculative_tokens=k, max_batch=8
        )
        out[str(k)] = result.stats["acceptance_length"]
        print(f"acceptance length K={k}: {out[str(k)]:.2f}", file=sys.stderr)
    return out
