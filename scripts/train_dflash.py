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
:mod:`train_eagle3`'s.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mtp_jax.checkpoint.safetensors_io import CheckpointReader  # noqa: E402
from mtp_jax.config import ModelConfig  # noqa: E402
from mtp_jax.drafts.dflash.checkpoint import load_dflash  # noqa: E402
from mtp_jax.drafts.dflash.config import DFlashConfig, dflash_default_layers, parse_dflash_config  # noqa: E402
from mtp_jax.drafts.dflash.draft import block_forward, context_rows, dflash_features  # noqa: E402
from mtp_jax.drafts.dflash.export import dflash_hub_tensors_from_params  # noqa: E402
from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors  # noqa: E402
from mtp_jax.synthetic import write_hub_checkpoint  # noqa: E402
from mtp_jax.targets import target_for  # noqa: E402
from mtp_jax.targets.base import head_logits, lm_head  # noqa: E402
from mtp_jax.train import target_cache  # noqa: E402
from mtp_jax.train.cards import (  # noqa: E402
    acceptance_setup,
    data_sentence,
    own_text_clause,
    rewrite_card,
    usage_line,
)
from mtp_jax.train.data import BOS, EOS  # noqa: E402
from mtp_jax.train.frozen import (  # noqa: E402
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
from mtp_jax.train.loop import make_optimizer  # noqa: E402

PAD = 2  # <|pad|> of the embedded models' tokenizer: the mask token


def draft_config(
    target: dict, cfg: ModelConfig, layers: int, layer_ids: list[int], block: int, mask: int = PAD
) -> dict:
    """The draft's config.json: ``layers`` Qwen3-style layers at the target's width (GQA like a
    Llama target's attention; for a DeepSeek-V3 target, its head count and an even split)."""
    heads = target["num_attention_heads"]
    kv = target.get("num_key_value_heads", heads)
    if target["model_type"] != "llama":
        kv = max(1, heads // 2)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": cfg.hidden_size // heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": target["rope_theta"],
        "rope_scaling": target.get("rope_scaling") if target["model_type"] == "llama" else None,
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_hidden_layers,
        "block_size": block,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": layer_ids},
        "bos_token_id": target.get("bos_token_id", BOS),
        "eos_token_id": target.get("eos_token_id", EOS),
        "torch_dtype": "bfloat16",
    }


def init_draft(
    raw: dict, cfg: ModelConfig, seed: int, params: dict | None = None, ids: np.ndarray | None = None
) -> tuple[DFlashConfig, dict]:
    """N(0, 0.02) projections (output projections / sqrt(2 n)), unit norms, built in the hub layout
    and read back by the loader (with a draft vocabulary ``ids``: its ``d2t``, the head's columns
    from the target's ``params``)."""
    dcfg = parse_dflash_config(raw)
    n = len(raw["dflash_config"]["target_layer_ids"])
    tensors = dflash_hub_tensors(dcfg, n, seed, 0.02, draft_ids=ids)
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = np.ones_like(tensors[name])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] / math.sqrt(2.0 * dcfg.num_hidden_layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, raw, tensors)
        reader = CheckpointReader(path)
        return load_dflash(reader, raw, cfg, jnp.float32, strict=True, verbose=False, target_params=params)


FIXED = ("draft_to_target", "lm_head")  # a draft vocabulary's ids and the target head's columns: not trained


def anchors_for(seed: int, step: int, batch: int, count: int, length: int, block: int) -> np.ndarray:
    """[batch, count] anchor positions in 0..length-block, drawn from (seed, step): resumable."""
    rng = np.random.default_rng([seed, step, 2])
    return np.sort(rng.integers(0, length - block + 1, (batch, count)), axis=1).astype(np.int32)


def draft_losses(
    tree: dict,
    params: dict,
    cfg: ModelConfig,
    dcfg: DFlashConfig,
    window: jax.Array,
    anchors: jax.Array,
    gamma: float,
    cached: dict | None = None,
) -> tuple[jax.Array, dict]:
    """Windows [b, s] with anchors [b, n]: the frozen target's features and distributions, then the
    n blocks per window in one forward (each over the context before its anchor). Block row j's soft
    cross-entropy is against the target's distribution for the token at anchor + j (restricted to
    the draft vocabulary ``tree["draft_to_target"]`` when there is one); ``agreement``: the draft's
    argmax (as a target id) equals the target's greedy token there.

    ``cached``: the target's rows for the window's first s - 1 tokens from a target cache
    (features [b, s-1, F], top_ids / top_logp [b, s-1, k]) instead of running the target."""
    inputs = window[:, :-1]
    ids = tree.get("draft_to_target")
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if cached is None:
        hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions, capture=dcfg.capture)
        features = jax.lax.stop_gradient(dflash_features(dcfg, cfg.num_hidden_layers, hidden))
        logits = jax.lax.stop_gradient(lm_head(params, hidden.post_norm))  # row r predicts token r+1
    else:
        features = cached["features"]
    full = {**params, "dflash": tree}
    bs = dcfg.block_size
    offsets = jnp.arange(bs, dtype=jnp.int32)
    block_pos = anchors[:, :, None] + offsets  # [b, n, bs]
    blocks = jnp.full(block_pos.shape, dcfg.mask_token_id, window.dtype)
    blocks = blocks.at[:, :, 0].set(jnp.take_along_axis(inputs, anchors, axis=1))
    visible = positions[:, None, :] < anchors[:, :, None]  # [b, n, t]: context strictly before
    normed = block_forward(
        full, dcfg, blocks, block_pos, context_rows(full, dcfg, features), positions, visible
    )
    rows = (block_pos[:, :, 1:] - 1).reshape(b, -1)  # target logits row predicting each block row
    shape = block_pos[:, :, 1:].shape
    if cached is None:
        picked = jnp.take_along_axis(logits, rows[..., None], axis=1).reshape(*shape, -1)
        teacher = target_cache.dense_teacher(picked, ids)
    else:
        top = [jnp.take_along_axis(cached[k], rows[..., None], axis=1) for k in ("top_ids", "top_logp")]
        teacher = target_cache.top_k_teacher(*(x.reshape(*shape, -1) for x in top), ids, cfg.vocab_size)
    if ids is None:
        logp = jax.nn.log_softmax(lm_head(full, normed[:, :, 1:]), axis=-1)
        chosen = jnp.argmax(logp, -1)
    else:  # over the draft vocabulary (draft ids), argmax mapped back to target ids
        logp = jax.nn.log_softmax(head_logits(tree["lm_head"], normed[:, :, 1:]), axis=-1)
        chosen = ids[jnp.argmax(logp, -1)]
    per_row = -(teacher["probs"] * logp).sum(-1).mean((0, 1))  # [bs - 1]
    agree = (chosen == teacher["greedy"]).mean((0, 1))
    weights = np.exp(-np.arange(bs - 1) / gamma)
    total = (per_row * (weights / weights.sum())).sum()
    aux = {"loss": total, "level_loss": per_row, "level_agreement": agree}
    if ids is not None:
        aux["coverage"] = teacher["covered"].mean()
    return total, aux


def held_out_means(
    aux_of, stream: np.ndarray, length: int, count: int, anchors: int, block: int
) -> dict[str, list | float]:
    """Mean held-out numbers (``aux_of(windows, anchors)``: a draft's loss aux) over ``count`` fixed,
    evenly spaced windows of ``length`` tokens, each with ``anchors`` fixed anchors."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    windows = np.stack([stream[s : s + length] for s in starts])
    totals: dict[str, np.ndarray] = {}
    for i in range(0, count, 8):
        w = windows[i : i + 8]
        a = anchors_for(0, i, len(w), anchors, length - 1, block)
        aux = aux_of(jnp.asarray(w), jnp.asarray(a))
        for key, value in aux.items():
            totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64) * len(w)
    return {k: (v / count).tolist() for k, v in totals.items()}


def evaluate(
    tree, params, cfg, dcfg, stream: np.ndarray, length: int, count: int, anchors: int, gamma: float
) -> dict:
    """Mean held-out numbers over ``count`` fixed, evenly spaced windows with fixed anchors."""
    fn = jax.jit(lambda t, w, a, p: draft_losses(t, p, cfg, dcfg, w, a, gamma)[1])
    block = dcfg.block_size
    return held_out_means(lambda w, a: fn(tree, w, a, params), stream, length, count, anchors, block)


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
            args.mask_token_id = 0 if data == "chat" else PAD  # chat conversations never contain id 0
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
    attach_target_cache(
        run, dcfg.capture, lambda hidden: dflash_features(dcfg, cfg.num_hidden_layers, hidden), "DFlash"
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
