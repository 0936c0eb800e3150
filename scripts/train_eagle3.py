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
from mtp_jax.drafts.eagle3.checkpoint import load_eagle3  # noqa: E402
from mtp_jax.drafts.eagle3.config import Eagle3Config, parse_eagle3_config  # noqa: E402
from mtp_jax.drafts.eagle3.draft import draft_vocab_logits, eagle3_chain_teacher_forced, fused_features  # noqa: E402
from mtp_jax.drafts.eagle3.export import eagle3_hub_tensors_from_params  # noqa: E402
from mtp_jax.drafts.eagle3.synthetic import eagle3_hub_tensors  # noqa: E402
from mtp_jax.synthetic import write_hub_checkpoint  # noqa: E402
from mtp_jax.targets import target_for  # noqa: E402
from mtp_jax.targets.base import lm_head  # noqa: E402
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config  # noqa: E402
from mtp_jax.train import target_cache  # noqa: E402
from mtp_jax.train.cards import acceptance_setup, data_sentence, own_text_clause, rewrite_card, usage_line  # noqa: E402
from mtp_jax.train.data import (  # noqa: E402  (the data pipeline the targets were trained with)
    BOS,
    EOS,
)
from mtp_jax.train.frozen import (  # noqa: E402
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
from mtp_jax.train.loop import make_optimizer  # noqa: E402

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
