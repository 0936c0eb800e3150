"""Train the embedded default model: a tiny DeepSeek-V3 (MLA, a dense layer then MoE layers with
group-limited routing) jointly with its MTP layer, on the Python standard library's source code.

    python scripts/train_tiny.py --out checkpoints/tiny-deepseek-v3-stdlib          # ~35 min, 2 cores
    python scripts/train_tiny.py --out /tmp/smoke --preset smoke --steps 3          # seconds

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

The training state (parameters, optimizer state, step) is saved with orbax to ``--workdir`` every
``--save-every`` steps; rerunning the same command resumes from the latest save. At the end the
model is written in the exact Hugging Face layout (bf16 safetensors, ``config.json`` with
``num_nextn_predict_layers: 1``, the MTP layer as layer N, tokenizer, generation config, a model
card and ``eval.json`` with the held-out numbers that the tests check), atomically.
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
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtp_jax.checkpoint.deepseek_v3 import load_params
from mtp_jax.checkpoint.export import hub_tensors_from_params
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.checkpoint.synthetic import hub_tensors, write_hub_checkpoint
from mtp_jax.config import DeepseekV3Config
from mtp_jax.drafts.mtp import mtp_forward
from mtp_jax.models.deepseek_v3 import forward, lm_head

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]
BOS, EOS = 0, 1
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}
HELDOUT_PERCENT = 5
MTP_WEIGHT = 0.3  # λ of the DeepSeek-V3 report for the first 10T tokens
BIAS_RATE = 0.001  # γ of the DeepSeek-V3 report


def model_config(vocab_size: int, preset: str) -> dict:
    """The architecture: every DeepSeek-V3 feature at a size that trains on two CPU cores."""
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


# --- data -------------------------------------------------------------------------------------


def stdlib_modules(max_files: int | None = None) -> tuple[str, list[str], list[str]]:
    """(stdlib root, train paths, held-out paths), relative to the root, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        paths += [os.path.relpath(os.path.join(d, f), root) for f in sorted(files) if f.endswith(".py")]
    if not paths:
        raise SystemExit(f"no .py files under the standard library at {root}")
    if max_files:
        paths = paths[:max_files]

    def heldout(rel: str) -> bool:
        return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT

    train = [p for p in paths if not heldout(p)]
    held = [p for p in paths if heldout(p)]
    if not held:  # tiny smoke slices: still hold one module out
        held = [train.pop()]
    return root, train, held


def read_text(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All documents as one int32 stream: <|bos|> doc <|eos|> <|bos|> doc <|eos|> ..."""
    parts = []
    for enc in tok.encode_batch(texts):
        parts.append(np.asarray([BOS, *enc.ids, EOS], dtype=np.int32))
    return np.concatenate(parts)


def batch_at(stream: np.ndarray, seed: int, step: int, batch: int, length: int) -> np.ndarray:
    """Windows [batch, length] of the stream at offsets drawn from (seed, step): resumable."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - length, batch)
    return np.stack([stream[s : s + length] for s in starts])


# --- model ------------------------------------------------------------------------------------


def init_hub_tensors(cfg: DeepseekV3Config, seed: int) -> dict[str, np.ndarray]:
    """Hub-layout initial weights: N(0, 0.02) projections (output projections scaled by
    1/sqrt(2·layers)), unit norms, zero correction biases; the MTP copies of the embedding and
    head are the main ones (shared, as in DeepSeek-V3)."""
    shapes = hub_tensors(cfg, seed=0)  # only the names and shapes are used
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / math.sqrt(2 * (cfg.num_hidden_layers + 1))
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
    for k in range(cfg.num_nextn_predict_layers):
        pre = f"model.layers.{cfg.num_hidden_layers + k}."
        tensors[f"{pre}embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[f"{pre}shared_head.head.weight"] = tensors["lm_head.weight"]
    return tensors


def init_params(cfg: DeepseekV3Config, config: dict, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, config, init_hub_tensors(cfg, seed))
        return load_params(CheckpointReader(path), cfg, jnp.float32, strict=True)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0].mean()


def losses(params: dict, cfg: DeepseekV3Config, window: jax.Array) -> tuple[jax.Array, dict]:
    """Main and MTP losses on windows [b, s]: main predicts window[:, 1:], MTP window[:, 2:]."""
    inputs = window[:, :-1]
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _ = forward(params, cfg, inputs, positions, dispatch="dense")
    logits = lm_head(params, hidden.post_norm)
    main = cross_entropy(logits, window[:, 1:])
    mtp = mtp_forward(
        params, cfg, window[:, 1:-1], hidden.post_norm[:, :-1], positions[:, :-1], dispatch="dense"
    )
    mtp_loss = cross_entropy(mtp.logits, window[:, 2:])
    # Teacher-forced draft agreement: the MTP's guess for t_{i+2} equals the target's greedy
    # choice at i+1 (given the true t_{i+1}); this is the K = 1 acceptance rate at temperature 0.
    agree = (jnp.argmax(mtp.logits, -1) == jnp.argmax(logits[:, 1:], -1)).mean()
    aux = {
        "loss": main,
        "mtp_loss": mtp_loss,
        "mtp_agreement": agree,
        "moe_load": hidden.expert_load,
        "mtp_load": mtp.expert_load,
    }
    return main + MTP_WEIGHT * mtp_loss, aux


def balance_bias(params: dict, aux: dict) -> dict:
    """DeepSeek-V3's auxiliary-loss-free balancing: bias += γ · sign(mean load - load)."""

    def nudge(bias: jax.Array, load: jax.Array) -> jax.Array:
        return bias + BIAS_RATE * jnp.sign(load.mean(-1, keepdims=True) - load)

    params = dict(params)
    params["moe"] = _with_bias(params["moe"], nudge(params["moe"]["mlp"]["bias"], aux["moe_load"]))
    mtp_bias = params["mtp"]["layer"]["mlp"]["bias"]
    layer = _with_bias(params["mtp"]["layer"], nudge(mtp_bias, aux["mtp_load"][None]))
    params["mtp"] = {**params["mtp"], "layer": layer}
    return params


def _with_bias(stack: dict, bias: jax.Array) -> dict:
    return {**stack, "mlp": {**stack["mlp"], "bias": bias}}


def decay_mask(params: dict) -> dict:
    """Weight decay on projections, embeddings and routers; never on norms or correction biases."""

    def keep(path, _) -> bool:
        name = str(path[-1].key)
        return not (name.endswith("norm") or name == "bias")

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(args: argparse.Namespace, params: dict) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup, max(args.steps - 1, 1)), max(args.steps, 2), args.lr * 0.1
    )
    frozen = jax.tree_util.tree_map_with_path(lambda p, _: str(p[-1].key) == "bias", params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask(params)),
        optax.masked(optax.set_to_zero(), frozen),  # correction biases move only by balance_bias
    )


# --- the run ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Meter:
    """A one-line progress display: step, loss, MTP loss and agreement, tokens/s, ETA."""

    total: int
    tokens_per_step: int
    start: float = dataclasses.field(default_factory=time.perf_counter)
    first_step: int = 0
    tty: bool = dataclasses.field(default_factory=lambda: sys.stderr.isatty())
    last: float = -math.inf

    def show(self, step: int, aux: dict, force: bool = False) -> None:
        now = time.perf_counter()
        if not (self.tty or force or now - self.last >= 10):
            return
        self.last = now
        done = step - self.first_step
        rate = done * self.tokens_per_step / max(now - self.start, 1e-9)
        eta = (self.total - step) * self.tokens_per_step / rate if rate else math.inf
        frac = step / self.total
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = (
            f"train [{bar}] step {step}/{self.total} loss {aux['loss']:.3f} "
            f"mtp {aux['mtp_loss']:.3f} agree {aux['mtp_agreement']:.2f} "
            f"{rate:,.0f} tok/s ETA {eta / 60:.1f} min"
        )
        sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
        sys.stderr.flush()


def evaluate(params: dict, cfg: DeepseekV3Config, stream: np.ndarray, length: int, count: int) -> dict:
    """Mean held-out losses over ``count`` fixed, evenly spaced windows."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    windows = np.stack([stream[s : s + length] for s in starts])
    fn = jax.jit(lambda p, w: losses(p, cfg, w)[1])
    totals: dict[str, float] = {}
    for i in range(0, count, 8):
        aux = fn(params, jnp.asarray(windows[i : i + 8]))
        for key in ("loss", "mtp_loss", "mtp_agreement"):
            totals[key] = totals.get(key, 0.0) + float(aux[key]) * len(windows[i : i + 8])
    out = {k: v / count for k, v in totals.items()}
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
    parser.add_argument("--preset", default="default", choices=["default", "smoke"])
    parser.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size")
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
    tok = train_tokenizer(train_texts, args.vocab)
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(
        f"tokenizer: {args.vocab} BPE tokens; {len(train_stream):,} train / {len(held_stream):,} "
        f"held-out tokens ({time.perf_counter() - t0:.0f}s)",
        file=sys.stderr,
    )

    config = model_config(args.vocab, args.preset)
    cfg = DeepseekV3Config.from_dict(config)
    params = init_params(cfg, config, args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    optimizer = make_optimizer(args, params)
    opt_state = optimizer.init(params)

    manager = ocp.CheckpointManager(workdir, options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        params, opt_state = state["params"], state["opt_state"]
        print(f"resuming from step {start} in {workdir}", file=sys.stderr)

    @jax.jit
    def train_step(params, opt_state, window):
        (_, aux), grads = jax.value_and_grad(lambda p: losses(p, cfg, window), has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = balance_bias(optax.apply_updates(params, updates), aux)
        return params, opt_state, aux

    length = args.seq + 1
    meter = Meter(args.steps, args.batch * args.seq, first_step=start)
    print(
        f"model: {n_params / 1e6:.2f}M parameters; training {args.steps} steps x {args.batch} x "
        f"{args.seq} tokens",
        file=sys.stderr,
    )
    aux = None
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    for step in range(start, end):
        window = jnp.asarray(batch_at(train_stream, args.seed, step, args.batch, length))
        params, opt_state, aux = train_step(params, opt_state, window)
        if not np.isfinite(float(aux["loss"])):
            raise SystemExit(f"loss is {float(aux['loss'])} at step {step}; lower --lr")
        stats = {k: float(aux[k]) for k in ("loss", "mtp_loss", "mtp_agreement")}
        meter.show(step + 1, stats, force=step + 1 == args.steps)
        if (step + 1) % args.save_every == 0 or step + 1 == end:
            manager.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    manager.wait_until_finished()
    if end < args.steps:
        print(f"stopped after step {end}; rerun the same command to resume from {workdir}", file=sys.stderr)
        return 0
    if meter.tty:
        sys.stderr.write("\n")
    train_seconds = time.perf_counter() - meter.start

    held = evaluate(params, cfg, held_stream, length, args.eval_windows)
    print(
        f"held-out: loss {held['loss']:.3f} (perplexity {held['perplexity']:.2f}), MTP loss "
        f"{held['mtp_loss']:.3f}, teacher-forced MTP agreement {held['mtp_agreement']:.3f}",
        file=sys.stderr,
    )
    loads = np.asarray(aux["moe_load"]) if aux is not None else None
    report = {
        "data": {
            "source": "Python standard library source code (.py files; tests, demos, site-packages excluded)",
            "python": platform.python_version(),
            "train_modules": len(train_files),
            "heldout_modules": len(held_files),
            "heldout_percent": HELDOUT_PERCENT,
            "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(held_stream)),
        },
        "training": {
            "steps": args.steps,
            "batch": args.batch,
            "seq": args.seq,
            "tokens_seen": args.steps * args.batch * args.seq,
            "lr": args.lr,
            "warmup": args.warmup,
            "seed": args.seed,
            "mtp_weight": MTP_WEIGHT,
            "bias_rate": BIAS_RATE,
            "seconds": round(train_seconds, 1),
            "resumed_from": start,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__}",
            "final_expert_load_min_max": None if loads is None else [float(loads.min()), float(loads.max())],
        },
        "parameters": int(n_params),
        "heldout": held,
        "heldout_modules": held_files,
    }
    write_checkpoint(args.out, config, cfg, params, tok, report, held_texts, args.acceptance_k)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f}s in all)", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def snippet(tok: Tokenizer, held_texts: list[str], tokens: int = 256) -> str:
    """A held-out passage of about ``tokens`` tokens, cut at line ends, for the perplexity test."""
    text = max(held_texts, key=len)
    lines, out = text.splitlines(keepends=True), []
    for line in lines[20:]:
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
    cfg: DeepseekV3Config, params: dict, tok: Tokenizer, texts: list[str], ks: list[int]
) -> dict:
    """Greedy acceptance length of K MTP drafts over the held-out prompts (64 new tokens)."""
    from mtp_jax.model import Model

    model = Model(cfg, params, dtype="float32", eos_token_ids=[EOS])
    ids = [[BOS, *tok.encode(t).ids] for t in texts]
    out = {}
    for k in ks:
        result = model.generate(ids, max_new_tokens=64, draft="mtp", num_speculative_tokens=k, max_batch=8)
        out[str(k)] = result.stats["acceptance_length"]
        print(f"acceptance length K={k}: {out[str(k)]:.2f}", file=sys.stderr)
    return out


def write_checkpoint(
    out: str,
    config: dict,
    cfg: DeepseekV3Config,
    params: dict,
    tok: Tokenizer,
    report: dict,
    held_texts: list[str],
    acceptance_k: list[int],
) -> None:
    """Hub layout (bf16), tokenizer, generation config, eval.json and the model card, atomically."""
    tensors = hub_tensors_from_params(params, cfg, ml_dtypes.bfloat16)
    passage = snippet(tok, held_texts)
    ids = [BOS, *tok.encode(passage).ids]
    # The recorded bound is measured on the bf16 weights that are shipped, in float32 compute.
    exported = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, ml_dtypes.bfloat16), jnp.float32), params)
    window = jnp.asarray([ids])
    positions = jnp.arange(len(ids) - 1, dtype=jnp.int32)[None]
    hidden, _ = forward(exported, cfg, window[:, :-1], positions)
    logp = jax.nn.log_softmax(lm_head(exported, hidden.post_norm), -1)
    nll = -jnp.take_along_axis(logp, window[:, 1:, None], -1).mean()
    report["snippet"] = {"text": passage, "tokens": len(ids), "perplexity": math.exp(float(nll))}
    report["prompts"] = prompts(held_texts)
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
            f.write(model_card(config, report))
        write_hub_checkpoint(out, config, tensors, extra_files=files)


def rewrite_card(directory: str) -> None:
    """Re-render a trained checkpoint's model card from its config.json and eval.json."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(directory, "eval.json"), encoding="utf-8") as f:
        report = json.load(f)
    tmp = os.path.join(directory, f".README.md.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(model_card(config, report))
    os.replace(tmp, os.path.join(directory, "README.md"))
    print(f"rewrote {directory}/README.md", file=sys.stderr)


def model_card(config: dict, r: dict) -> str:
    d, t, h, c = r["data"], r["training"], r["heldout"], config
    shape = f"{c['hidden_size']} / {c['num_hidden_layers']} (+1 MTP) / {c['num_attention_heads']}"
    experts = (
        f"{c['n_routed_experts']} routed (top {c['num_experts_per_tok']}, {c['n_group']} groups, "
        f"top {c['topk_group']}) + {c['n_shared_experts']} shared"
    )
    acc = r.get("acceptance")
    acc_lines = (
        "\n".join(f"| {k} | {v:.2f} |" for k, v in acc.items())
        if acc
        else "| - | measured by `mtp-jax bench` (see BENCHMARKS.md) |"
    )
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
{t["steps"]} steps of {t["batch"]} x {t["seq"]} tokens ({t["tokens_seen"]:,} tokens), AdamW (lr {t["lr"]},
warm-up {t["warmup"]}, cosine decay), loss = next-token CE + {t["mtp_weight"]} x MTP CE, auxiliary-loss-free
expert balancing (bias rate {t["bias_rate"]}), seed {t["seed"]}; {t["seconds"] / 60:.1f} minutes on
{t["machine"]}.

## Held-out results
| | |
|---|---|
| next-token loss / perplexity | {h["loss"]:.3f} / {h["perplexity"]:.2f} |
| MTP loss (t+2) | {h["mtp_loss"]:.3f} |
| teacher-forced MTP agreement with the target's greedy token | {h["mtp_agreement"]:.3f} |
| perplexity of the test snippet (`eval.json`) | {r["snippet"]["perplexity"]:.2f} |

Acceptance length (tokens per step, greedy, MTP drafts) on the held-out prompts in `eval.json`:

| K | acceptance length |
|---|---|
{acc_lines}

Decode speed, plain against speculative, is in the repository's BENCHMARKS.md (`mtp-jax bench`).
"""


if __name__ == "__main__":
    sys.exit(main())
