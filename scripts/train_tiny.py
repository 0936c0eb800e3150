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
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from tokenizers import Tokenizer

from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from mtp_jax.config import ModelConfig, parse_config
from mtp_jax.drafts.mtp.training import BIAS_RATE, MTP_WEIGHT, REACH, balance_bias
from mtp_jax.drafts.mtp.training import losses as mtp_losses
from mtp_jax.drafts.teacher import cross_entropy
from mtp_jax.export import hub_tensors_from_params
from mtp_jax.targets import target_for
from mtp_jax.targets.base import lm_head
from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
from mtp_jax.targets.llama.config import Llama3Config
from mtp_jax.targets.llama.synthetic import llama_hub_tensors
from mtp_jax.train import cards
from mtp_jax.train.cards import ACCEPTANCE_TOKENS
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


def llama_config(vocab_size: int, preset: str) -> dict:
    """A Llama 3.1-style architecture (GQA 3:1, llama3 rope scaling, untied head) at a size that
    trains on two CPU cores."""
    sizes = {"default": (192, 6, 512, 6, 2), "smoke": (32, 2, 64, 4, 2), "draft": (64, 2, 192, 4, 2)}
    d, layers, ffn, heads, kv_heads = sizes[preset]
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
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "torch_dtype": "bfloat16",
    }


def model_config(vocab_size: int, preset: str, arch: str = "deepseek_v3") -> dict:
    """The architecture: every DeepSeek-V3 feature (or Llama 3's) at a size that trains on two CPU
    cores."""
    if arch == "llama":
        return llama_config(vocab_size, preset)
    sizes = {
        # d, layers, dense ffn, experts, expert ffn, heads, q_lora, kv_lora
        "default": (128, 8, 384, 8, 64, 4, 64, 48),
        "smoke": (32, 3, 64, 4, 16, 2, 16, 16),
    }
    d, layers, ffn, experts, expert_ffn, heads, q_lora, kv_lora = sizes[preset]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": d,
        "intermediate_size": ffn,
        "moe_intermediate_size": expert_ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": 32 if preset == "default" else 8,
        "qk_rope_head_dim": 16 if preset == "default" else 8,
        "v_head_dim": 32 if preset == "default" else 8,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4 if experts >= 8 else 2,
        "topk_group": 2 if experts >= 8 else 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "torch_dtype": "bfloat16",
    }


def init_hub_tensors(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Hub-layout initial weights: N(0, 0.02) projections (output projections scaled by
    1/sqrt(2·layers)), unit norms, zero correction biases; the MTP copies of the embedding and
    head are the main ones (shared, as in DeepSeek-V3)."""
    llama = isinstance(cfg, Llama3Config)
    shapes = (llama_hub_tensors if llama else hub_tensors)(cfg, seed=0)  # only names and shapes are used
    rng = np.random.default_rng(seed)
    mtp_layers = 0 if llama else cfg.num_nextn_predict_layers
    out_scale = 1.0 / math.sqrt(2 * (cfg.num_hidden_layers + mtp_layers))
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name].shape
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = np.ones(shape, np.float32)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = np.zeros(shape, np.float32)
        else:
            std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            tensors[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    for k in range(mtp_layers):
        pre = f"model.layers.{cfg.num_hidden_layers + k}."
        tensors[f"{pre}embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[f"{pre}shared_head.head.weight"] = tensors["lm_head.weight"]
    return tensors


def init_params(cfg: ModelConfig, config: dict, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, config, init_hub_tensors(cfg, seed))
        return load_params(path, cfg)


def losses(
    params: dict, cfg: ModelConfig, window: jax.Array, depth: int = 1, labels: str = "data"
) -> tuple[jax.Array, dict]:
    """The objective: a Llama target's next-token cross-entropy alone (it has no draft layer), a
    DeepSeek-V3's jointly with its MTP layer (:func:`mtp_jax.drafts.mtp.training.losses`)."""
    if isinstance(cfg, Llama3Config):
        if labels not in ("data", "target"):
            raise ValueError(f"labels must be 'data' or 'target', got {labels!r}")
        return target_losses(params, cfg, window)
    return mtp_losses(params, cfg, window, depth, labels)


def target_losses(params: dict, cfg: ModelConfig, window: jax.Array) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy of the target on windows [b, s] predicting window[:, 1:]."""
    inputs = window[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions)
    main = cross_entropy(lm_head(params, hidden.post_norm), window[:, 1:])
    return main, {"loss": main}


# --- the run ----------------------------------------------------------------------------------


def evaluate(params: dict, cfg: ModelConfig, stream: np.ndarray, length: int, count: int, depth: int) -> dict:
    """Mean held-out losses over ``count`` fixed, evenly spaced windows (MTP levels 1..depth)."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    windows = np.stack([stream[s : s + length] for s in starts])
    fn = jax.jit(lambda p, w: losses(p, cfg, w, depth)[1])
    keys = ("loss", "mtp_loss", "mtp_agreement", "level_loss", "level_agreement")
    totals: dict[str, np.ndarray] = {}
    for i in range(0, count, 8):
        aux = fn(params, jnp.asarray(windows[i : i + 8]))
        for key in (k for k in keys if k in aux):
            totals[key] = totals.get(key, 0.0) + np.asarray(aux[key], np.float64) * len(windows[i : i + 8])
    out = {k: (v / count).tolist() for k, v in totals.items()}
    out["perplexity"] = math.exp(out["loss"])
    return out


def main() -> int:
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
    args = parser.parse_args()
    if args.card:
        rewrite_card(args.card)
        return 0
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
    workdir = os.path.abspath(args.workdir or args.out.rstrip("/") + ".train")

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

    base = None
    if args.init_from:
        with open(os.path.join(args.init_from, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        cfg = parse_config(config)
        params = load_params(args.init_from, cfg)
        eval_path = os.path.join(args.init_from, "eval.json")
        if os.path.isfile(eval_path):
            with open(eval_path, encoding="utf-8") as f:
                base = json.load(f)
    else:
        config = model_config(tok.get_vocab_size(), args.preset, args.arch)
        cfg = parse_config(config)
        params = init_params(cfg, config, args.seed)
    has_mtp = "mtp" in params
    n_params = sum(x.size for x in jax.tree.leaves(params))
    only_mtp = args.train == "mtp"

    def trainable(params: dict) -> dict:
        return params["mtp"] if only_mtp else params

    optimizer = make_optimizer(args, trainable(params))
    opt_state = optimizer.init(trainable(params))

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

    length = args.seq + 1
    own = round(args.own_text * args.batch)
    if own:
        own_windows = load_or_make_continuations(
            workdir, cfg, params, train_stream, args.own_text_windows, length, args.seed
        )
    objective = f" (MTP depth {args.mtp_depth})" if has_mtp else " (next-token loss)"
    print(
        f"model: {cfg.model_type}, {n_params / 1e6:.2f}M parameters; training "
        f"{'the MTP layer' if only_mtp else 'all'}{objective} for {args.steps} steps x {args.batch} x "
        f"{args.seq} tokens",
        file=sys.stderr,
    )

    def step_fn(state: dict, window: jax.Array) -> tuple[dict, dict]:
        params, opt_state, aux = train_step(state["params"], state["opt_state"], window)
        return {"params": params, "opt_state": opt_state}, aux

    state = {"params": params, "opt_state": opt_state}
    done = train_loop(args, workdir, state, step_fn, train_stream, own_windows if own else None)
    if done is None:
        return 0
    state, aux, start, train_seconds = done
    params = state["params"]

    held = evaluate(params, cfg, held_stream, length, args.eval_windows, max(args.mtp_depth, 3))
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
    loads = np.asarray(aux["moe_load"]) if aux is not None and "moe_load" in aux else None
    report = {
        "data": data_report(train_files, held_files, train_stream, held_stream),
        "training": {
            **run_report(args),
            "mtp_weight": MTP_WEIGHT,
            "trained": args.train,
            "mtp_depth": args.mtp_depth,
            "mtp_labels": args.mtp_labels,
            "own_text": args.own_text,
            "own_text_windows": args.own_text_windows if own else 0,
            "init_from": os.path.basename(os.path.normpath(args.init_from)) if args.init_from else None,
            "bias_rate": BIAS_RATE,
            "seconds": round(train_seconds, 1),
            "resumed_from": start,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__}",
            "final_expert_load_min_max": None if loads is None else [float(loads.min()), float(loads.max())],
            "tokenizer_from": os.path.basename(os.path.normpath(args.tokenizer_from))
            if args.tokenizer_from
            else None,
            "preset": args.preset,
        },
        "parameters": int(n_params),
        "heldout": held,
        "heldout_modules": held_files,
    }
    if not has_mtp:  # a target alone: no draft settings to record
        for key in ("mtp_weight", "mtp_depth", "mtp_labels", "own_text", "own_text_windows", "bias_rate"):
            report["training"].pop(key)
        report["training"].pop("final_expert_load_min_max")
    if base is not None:  # the run this one started from, as its own eval.json recorded it
        report["base"] = {k: base[k] for k in ("training", "heldout", "acceptance") if k in base}
        if "base" in base:
            report["base"]["base"] = base["base"]
    write_checkpoint(args.out, config, cfg, params, tok, report, held_texts, args.acceptance_k)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f}s in all)", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)
    if own:
        os.remove(continuations_path(workdir, args.own_text_windows, length, args.seed))
    return 0


def snippet(tok: Tokenizer, held_texts: list[str], tokens: int = 256) -> str:
    """A held-out passage of about ``tokens`` tokens, cut at line ends, for the perplexity test."""
    text = max(held_texts, key=len)
    lines, out = text.splitlines(keepends=True), []
    for line in lines[min(20, len(lines) // 2) :]:  # past the module docstring, if there is room
        out.append(line)
        if len(tok.encode("".join(out)).ids) >= tokens:
            break
    return "".join(out)


def prompts(held_texts: list[str], count: int = 32, chars: int = 160) -> list[str]:
    """Held-out prompts: the first ``chars`` characters of a ``def`` in held-out modules."""
    out = []
    for text in held_texts:
        at = 0
        while len(out) < count:
            at = text.find("\ndef ", at + 1)
            if at < 0:
                break
            out.append(text[at + 1 : at + 1 + chars])
    return out[:count]


def acceptance_lengths(
    cfg: ModelConfig, params: dict, tok: Tokenizer, texts: list[str], ks: list[int]
) -> dict:
    """Greedy acceptance length of K MTP drafts over the held-out prompts (ACCEPTANCE_TOKENS new
    tokens each)."""
    from mtp_jax.model import Model

    model = Model(cfg, params, dtype="float32", eos_token_ids=[EOS])
    ids = [[BOS, *tok.encode(t, add_special_tokens=False).ids] for t in texts]
    out = {}
    for k in ks:
        result = model.generate(
            ids, max_new_tokens=ACCEPTANCE_TOKENS, draft="mtp", num_speculative_tokens=k, max_batch=8
        )
        out[str(k)] = result.stats["acceptance_length"]
        print(f"acceptance length K={k}: {out[str(k)]:.2f}", file=sys.stderr)
    return out


def write_checkpoint(
    out: str,
    config: dict,
    cfg: ModelConfig,
    params: dict,
    tok: Tokenizer,
    report: dict,
    held_texts: list[str],
    acceptance_k: list[int],
) -> None:
    """Hub layout (bf16), tokenizer, generation config, eval.json and the model card, atomically."""
    tensors = hub_tensors_from_params(params, cfg, ml_dtypes.bfloat16)
    passage = snippet(tok, held_texts)
    ids = [BOS, *tok.encode(passage, add_special_tokens=False).ids]
    # The recorded bound is measured on the bf16 weights that are shipped, in float32 compute.
    exported = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, ml_dtypes.bfloat16), jnp.float32), params)
    window = jnp.asarray([ids])
    positions = jnp.arange(len(ids) - 1, dtype=jnp.int32)[None]
    hidden, _ = target_for(cfg).forward(exported, cfg, window[:, :-1], positions)
    logp = jax.nn.log_softmax(lm_head(exported, hidden.post_norm), -1)
    nll = -jnp.take_along_axis(logp, window[:, 1:, None], -1).mean()
    report["snippet"] = {"text": passage, "tokens": len(ids), "perplexity": math.exp(float(nll))}
    report["prompts"] = prompts(held_texts)
    if "mtp" in params:
        report["acceptance"] = acceptance_lengths(cfg, exported, tok, report["prompts"], acceptance_k)
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, content in (
            ("generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS}),
            ("eval.json", report),
        ):
            files[name] = os.path.join(tmp, name)
            with open(files[name], "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2)
                f.write("\n")
        files["tokenizer.json"] = os.path.join(tmp, "tokenizer.json")
        tok.save(files["tokenizer.json"])
        files["README.md"] = os.path.join(tmp, "README.md")
        with open(files["README.md"], "w", encoding="utf-8") as f:
            f.write(card_for(config, report))
        write_hub_checkpoint(out, config, tensors, extra_files=files)


def rewrite_card(directory: str, render: Callable[[dict, dict], str] | None = None) -> None:
    """:func:`mtp_jax.train.cards.rewrite_card` with this script's cards by default."""
    cards.rewrite_card(directory, render or card_for)


def card_for(config: dict, report: dict) -> str:
    return llama_card(config, report) if config["model_type"] == "llama" else model_card(config, report)


def llama_card(config: dict, r: dict) -> str:
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


def model_card(config: dict, r: dict) -> str:
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


if __name__ == "__main__":
    sys.exit(main())
