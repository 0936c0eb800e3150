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
cache built once (``--target-cache DIR``, :mod:`target_cache`: features and the top ``--cache-k``
teacher tokens per training token).

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
import dataclasses
import hashlib
import json
import math
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
import optax
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import target_cache  # noqa: E402
from train_tiny import (  # noqa: E402  (the data pipeline and optimizer the targets were trained with)
    ACCEPTANCE_TOKENS,
    BOS,
    EOS,
    continuations_path,
    data_report,
    load_or_make_continuations,
    load_params,
    make_optimizer,
    read_text,
    rewrite_card,
    run_report,
    stdlib_modules,
    token_stream,
    train_loop,
    training_window,
    window_starts,
)

import mtp_jax  # noqa: E402
from mtp_jax.checkpoint.safetensors_io import CheckpointReader  # noqa: E402
from mtp_jax.config import ModelConfig, parse_config  # noqa: E402
from mtp_jax.drafts.eagle3.checkpoint import load_eagle3  # noqa: E402
from mtp_jax.drafts.eagle3.config import Eagle3Config, parse_eagle3_config  # noqa: E402
from mtp_jax.drafts.eagle3.draft import draft_vocab_logits, eagle3_chain_teacher_forced, fused_features  # noqa: E402
from mtp_jax.drafts.eagle3.export import eagle3_hub_tensors_from_params  # noqa: E402
from mtp_jax.drafts.eagle3.synthetic import eagle3_hub_tensors  # noqa: E402
from mtp_jax.embedded import resolve_model_path  # noqa: E402
from mtp_jax.model import read_model_config  # noqa: E402
from mtp_jax.synthetic import write_hub_checkpoint  # noqa: E402
from mtp_jax.targets import target_for  # noqa: E402
from mtp_jax.targets.base import Hidden, lm_head  # noqa: E402
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config  # noqa: E402

LAYER_PREFIX = "layers.0."


# --- the draft's architecture ---------------------------------------------------------------------
def spread_layer_ids(num_layers: int) -> list[int]:
    """Three distinct captured layers, low / mid / high, as layer INPUT ids (vLLM's reading): the
    usual (2, L/2, L-3) when those are distinct, else evenly spread over 1..L-1."""
    usual = [2, num_layers // 2, num_layers - 3]
    if len(set(usual)) == 3 and all(0 <= i < num_layers for i in usual):
        return usual
    return [int(round(x)) for x in np.linspace(1, num_layers - 1, 3)]


def draft_config(target: dict, cfg: ModelConfig, attention: str, layer_ids: list[int], vocab: int) -> dict:
    """The draft's config.json: one layer of the target's own width and attention kind."""
    common = {
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": target["max_position_embeddings"],
        "rope_theta": target["rope_theta"],
        "tie_word_embeddings": False,
        "bos_token_id": target.get("bos_token_id", BOS),
        "eos_token_id": target.get("eos_token_id", EOS),
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }
    if attention == "mla":
        if not isinstance(cfg, DeepseekV3Config):
            raise SystemExit("--attention mla needs a DeepSeek-V3 target (its MLA widths are copied)")
        mla = {k: target[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")}
        return {
            "architectures": ["Eagle3DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v3",
            **common,
            **mla,
            "v_head_dim": target["v_head_dim"],
            "num_attention_heads": target["num_attention_heads"],
            "num_key_value_heads": target["num_attention_heads"],
            "intermediate_size": target["intermediate_size"],
            "rope_scaling": target.get("rope_scaling"),
        }
    heads = target["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **common,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads", heads),
        "head_dim": target.get("head_dim", cfg.hidden_size // heads),
        "intermediate_size": target["intermediate_size"],
        "rope_scaling": target.get("rope_scaling") if target["model_type"] == "llama" else None,
    }


def draft_vocabulary(streams: list[np.ndarray], vocab_size: int, size: int) -> np.ndarray:
    """The ``size`` most frequent token ids of the training data (ties: lower id first), ascending:
    draft id j is target id ids[j] (d2t[j] = ids[j] - j)."""
    counts = sum(np.bincount(s.ravel(), minlength=vocab_size) for s in streams)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:size]).astype(np.int32)


def init_draft(
    raw: dict, cfg: ModelConfig, params: dict, ids: np.ndarray, seed: int
) -> tuple[Eagle3Config, dict]:
    """Initial draft: N(0, 0.02) projections (output projections scaled by 1/sqrt(2)), unit norms,
    the head as the target's head rows of the draft vocabulary and the final norm as the target's;
    built in the hub layout and read back by the loader (so the tree is exactly a loaded one's)."""
    dcfg = parse_eagle3_config(raw, mla=raw["architectures"][0].startswith("Eagle3Deepseek"))
    tensors = eagle3_hub_tensors(dcfg, seed, 0.02, layer_prefix=LAYER_PREFIX, draft_ids=ids)
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = np.ones_like(tensors[name])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] / math.sqrt(2.0)
    head = np.asarray(lm_head(params, jnp.eye(cfg.hidden_size)))  # [d, V] whether tied or not
    tensors["lm_head.weight"] = np.ascontiguousarray(head[:, ids].T)
    tensors["norm.weight"] = np.asarray(params["final_norm"], np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, raw, tensors)
        return load_eagle3(CheckpointReader(path), raw, cfg, params, jnp.float32, strict=True, verbose=False)


# --- the objective --------------------------------------------------------------------------------
def draft_losses(
    tree: dict,
    params: dict,
    cfg: ModelConfig,
    dcfg: Eagle3Config,
    window: jax.Array,
    depth: int,
    decay: float,
    cached: dict | None = None,
) -> tuple[jax.Array, dict]:
    """Windows [b, s]: the frozen target's features and distributions, then the draft's ``depth``
    chained steps (:func:`eagle3_chain_teacher_forced`). Step j's soft cross-entropy is against the
    target's distribution for token i+j+1 restricted to the draft vocabulary; ``agreement``: the
    draft's argmax (as a target id) equals the target's greedy token there (step 1: the K = 1
    acceptance rate at temperature 0; step j: draft j's, given true earlier tokens).

    ``cached``: the target's rows for the window's first s - 1 tokens from a target cache
    (features [b, s-1, F], top_ids / top_logp [b, s-1, k]) instead of running the target."""
    ids = tree["draft_to_target"]
    if cached is None:
        inputs = window[:, :-1]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions, capture=dcfg.capture)
        feats = jax.lax.stop_gradient(fused_features(hidden.layers))
        logits = jax.lax.stop_gradient(lm_head(params, hidden.post_norm))  # row r predicts token r+1
        teacher = target_cache.dense_teacher(logits, ids)
    else:
        feats = cached["features"]
        teacher = target_cache.top_k_teacher(cached["top_ids"], cached["top_logp"], ids, cfg.vocab_size)
    full = {**params, "eagle3": tree}
    levels = eagle3_chain_teacher_forced(full, dcfg, window, feats, depth)
    n = levels[0].shape[1]
    losses, agree = [], []
    for j, normed in enumerate(levels, start=1):
        logp = jax.nn.log_softmax(draft_vocab_logits(full, normed), axis=-1)
        losses.append(-(teacher["probs"][:, j : j + n] * logp).sum(-1).mean())
        agree.append((ids[jnp.argmax(logp, -1)] == teacher["greedy"][:, j : j + n]).mean())
    weights = decay ** np.arange(depth) / np.sum(decay ** np.arange(depth))
    total = sum(float(w) * loss for w, loss in zip(weights, losses, strict=True))
    coverage = teacher["covered"][:, 1 : 1 + n].mean()
    return total, {
        "loss": total,
        "level_loss": jnp.stack(losses),
        "level_agreement": jnp.stack(agree),
        "coverage": coverage,
    }


def evaluate(
    tree, params, cfg, dcfg, stream: np.ndarray, length: int, count: int, depth: int, decay: float
) -> dict:
    """Mean held-out numbers over ``count`` fixed, evenly spaced windows."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    windows = np.stack([stream[s : s + length] for s in starts])
    fn = jax.jit(lambda t, w, p: draft_losses(t, p, cfg, dcfg, w, depth, decay)[1])
    totals: dict[str, np.ndarray] = {}
    for i in range(0, count, 8):
        aux = fn(tree, jnp.asarray(windows[i : i + 8]), params)
        for key, value in aux.items():
            totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64) * len(windows[i : i + 8])
    return {k: (v / count).tolist() for k, v in totals.items()}


# --- a run against a frozen target (shared with scripts/train_dflash.py) ---------------------------
def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every draft-training script against a frozen target takes."""
    parser.add_argument(
        "--target",
        help="the frozen target: a checkpoint directory trained here, or a real model (directory or .gguf); "
        "required unless --card",
    )
    parser.add_argument(
        "--data",
        default="auto",
        choices=["auto", "stdlib", "chat"],
        help="stdlib: the standard-library text the tiny targets were trained on; chat: the target's own "
        "replies to chat and code prompts (scripts/distill_data.py); auto: stdlib for a target trained "
        "here (it has eval.json), chat otherwise",
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
        "per training token into DIR (scripts/target_cache.py; resumable) and train from them instead of "
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
    data: dict = dataclasses.field(default_factory=dict)
    """eval.json's account of the data (chat data; stdlib data is described by its module split)."""
    train_starts: np.ndarray | None = None
    """Where each conversation starts in the train stream (chat data; None: one text)."""
    cache: Any = None
    """The target cache (:class:`target_cache.TargetCache`) when ``--target-cache`` is given."""

    def batch(self, step: int) -> dict:
        """Step ``step``'s batch: its windows [b, seq + 1] and, with a target cache, the cached rows
        of their first seq tokens (features, top_ids, top_logp)."""
        args = self.args
        window = training_window(args, self.train_stream, self.own_windows if self.own else None, step)
        out = {"window": jnp.asarray(window)}
        if self.cache is not None:
            starts = window_starts(len(self.train_stream), args.seed, step, args.batch, args.seq + 1)
            out.update({k: jnp.asarray(v) for k, v in self.cache.rows(starts, args.seq).items()})
        return out

    def encode_prompt(self, text: str) -> list[int]:
        """A held-out prompt as the target sees it: BOS + text (stdlib), or the chat-rendered user turn."""
        if self.data.get("kind") == "chat":
            return self.tok.encode_chat([{"role": "user", "content": text}])
        return [BOS, *self.tok.encode(text, add_special_tokens=False).ids]

    @property
    def length(self) -> int:
        return self.args.seq + 1


def start_run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    check: Callable[[ModelConfig, str], None] | None = None,
) -> Run:
    """Check the shared arguments (the smoke preset shrinks everything to seconds), load the frozen
    target and the data: the split it was trained on (stdlib), or its own replies (chat).
    ``check(cfg, data)`` checks the script's own arguments against the target's config before
    anything is loaded (a bad argument fails in a second)."""
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
    if data == "chat":
        args.own_text = 0.0  # the data already is the target's own text
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
    workdir = os.path.abspath(args.workdir or args.out.rstrip("/") + ".train")
    t0 = time.perf_counter()
    target_raw = read_model_config(args.target)
    cfg = parse_config(target_raw)
    if check is not None:
        check(cfg, data)
    if data == "chat":
        return start_chat_run(args, workdir, t0, target_raw)
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
    :mod:`distill_data` (generated once through mtp-jax, kept beside the training state)."""
    import distill_data

    model = mtp_jax.load(args.target, "float32", layer_buffers=False)
    codec = model.text
    if codec.chat_template is None:
        raise SystemExit(f"--target {args.target} has no chat template: chat data needs one")
    train, held = distill_data.build_prompts(args.max_files)
    train = train[: args.max_prompts]
    evaluation = distill_data.heldout_prompts(args.eval_prompts, args.max_files)
    streams = []
    for name, prompts in (("train", train), ("heldout", held)):
        path = distill_data.replies_path(
            args.replies_dir or os.path.dirname(workdir), args.target_name, name, args.reply_tokens
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        replies = distill_data.generate_replies(model, codec, prompts, path, args.reply_tokens)
        streams.append(distill_data.conversation_stream(codec, prompts, replies))
    (train_stream, train_starts), (held_stream, _) = streams
    print(
        f"data: {len(train)} train / {len(held)} held-out prompts; {len(train_stream):,} train / "
        f"{len(held_stream):,} held-out tokens ({time.perf_counter() - t0:.0f}s)",
        file=sys.stderr,
    )
    data = {
        "kind": "chat",
        "source": distill_data.SOURCE.format(version=platform.python_version()),
        "replies": f"the target's greedy replies, at most {args.reply_tokens} tokens, through mtp-jax",
        "train_prompts": len(train),
        "heldout_prompts": len(held),
        "train_tokens": int(len(train_stream)),
        "heldout_tokens": int(len(held_stream)),
    }
    return Run(
        args,
        workdir,
        0,
        target_raw,
        model.config,
        model.params,
        codec,
        {"prompts": [p["text"] for p in evaluation]},
        [],
        [],
        train_stream,
        held_stream,
        start=t0,
        data=data,
        train_starts=train_starts,
    )


def attach_target_cache(
    run: Run, capture: tuple[int, ...], features: Callable[[Hidden], jax.Array], kind: str
) -> None:
    """With ``--target-cache DIR``: build (or finish, or open) the cache of the target's
    ``features(hidden)`` over the training stream, one conversation per context, and make every
    step read it (:meth:`Run.batch`)."""
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
            num_speculative_tokens=3 if "mtp" in run.params else 0,
        )
    return run.own_windows


def partial_dir(args: argparse.Namespace) -> str:
    return args.partial or args.out.rstrip("/") + ".partial"


def with_step_count(opt_state: Any, step: int) -> Any:
    """Optimizer state whose step counters read ``step`` (the learning-rate schedule goes on)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.full_like(x, step) if getattr(p[-1], "name", None) == "count" else x, opt_state
    )


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
    """:func:`train_tiny.train_loop` on the run's data: (state, first step of this run, seconds), or
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
        partial = partial_dir(args)
        if load is None or not os.path.isfile(os.path.join(partial, "progress.json")):
            return None
        with open(os.path.join(partial, "config.json"), encoding="utf-8") as f:
            written = json.load(f)
            if {k: v for k, v in written.items() if k not in may_differ} != {
                k: v for k, v in raw.items() if k not in may_differ
            }:
                raise SystemExit(
                    f"{partial} holds a draft of another configuration; move it away to start afresh"
                )
        with open(os.path.join(partial, "progress.json"), encoding="utf-8") as f:
            step = int(json.load(f)["step"])
        tree = load(CheckpointReader(partial), raw)
        st = {**st, "draft": tree, "opt_state": with_step_count(st["opt_state"], step)}
        if "step" in st:
            st["step"] = jnp.asarray(step, st["step"].dtype)
        print(
            f"starting from the draft at step {step} in {partial} (fresh optimizer moments)", file=sys.stderr
        )
        exported[0] = step
        return st, step

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


def report_command() -> str:
    return " ".join(["python", f"scripts/{os.path.basename(sys.argv[0])}", *sys.argv[1:]])


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
            [run.encode_prompt(t) for t in prompts],
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
    model = mtp_jax.load(target, "float32", draft_model=draft)
    out = {}
    for k in ks:
        result = model.generate(
            ids, max_new_tokens=new_tokens, draft=method, num_speculative_tokens=k, max_batch=8
        )
        out[str(k)] = result.stats["acceptance_length"]
        print(f"acceptance length K={k}: {out[str(k)]:.2f}", file=sys.stderr)
    return out


def acceptance_setup(r: dict) -> str:
    """What a report's acceptance was measured on, for its card."""
    setup = r.get("acceptance_setup")
    if setup is None:
        return f"{ACCEPTANCE_TOKENS} new tokens on the target's held-out prompts"
    n, first = setup["new_tokens"], setup["prompts"]
    return f"{n} new tokens on the first {first} of the target's held-out prompts"


def data_sentence(d: dict) -> str:
    """The card's account of the training data, stdlib or chat."""
    if d.get("kind") == "chat":
        return (
            f"The target's own text: {d['replies']}, to {d['train_prompts']:,} "
            f"chat and code prompts built from the {d['source']} ({d['train_tokens']:,} tokens of "
            f"conversation; {d['heldout_prompts']} prompts of held-out modules and topics kept out)."
        )
    return (
        f"{d['train_modules']} standard-library modules of Python {d['python']} ({d['train_tokens']:,} "
        f"tokens; the target's split, {d['heldout_modules']} modules held out)."
    )


def own_text_clause(d: dict, t: dict) -> str:
    """How much of each batch was the target's own greedy text (all of it, for chat data)."""
    if d.get("kind") == "chat":
        return ""
    windows = f" from {t['own_text_windows']:,} windows" if t.get("own_text_windows") else ""
    return f"; {t['own_text']:.0%} of each batch{windows} of the target's own greedy continuations"


def usage_line(r: dict, method: str) -> str:
    """How to run the draft with its target."""
    if r["data"].get("kind") == "chat":
        model = r.get("target_path", r["target"])
        return (
            f"    mtp-jax generate --model {model} --draft {method} \\\n"
            f"        --draft-model checkpoints/{r['name']} \\\n"
            '        --chat "Write a Python function that reverses a string."'
        )
    return (
        f"    mtp-jax generate --model checkpoints/{r['target']} --draft {method} --draft-model "
        f'checkpoints/{r["name"]} \\\n        --prompt "def main():"'
    )


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
