"""A separate draft model (``draft="draft_model"``, vLLM's name; SGLang calls it standalone): a
smaller language model sharing the target's vocabulary proposes K tokens by decoding them itself.

Any checkpoint mtp-jax loads as a target (Llama 3, Qwen2, Qwen3, DeepSeek-V3: the targets of
:mod:`mtp_jax.targets`) can draft; ``load(target, draft_model=DIR)`` recognises one when DIR is
neither an EAGLE-3 nor a DFlash draft. It runs its own target-family forward (its own config,
weights and paged KV cache on the target's page ids) inside the unified step:

* catch-up: after each verification (and in prefill) the draft model reads the committed rows'
  tokens at their positions, plus the token that followed the last one (the bonus or first sampled
  token, which no model has read yet) at the position after it, writing its cache there; rejected
  drafts' entries beyond that are masked by position and overwritten later;
* propose: its logits at that last token give the first draft; each next draft feeds the previous
  one through the model (K chained one-token passes in all, the last one's pass skipped).

Its logits cover its own vocabulary: a draft vocabulary smaller than the target's is padded with
-inf (those tokens are never proposed), a larger one (padded embedding rows) is cut to the target's.
The parameters travel beside the target's, as ``params["draft_model"]`` (the draft's own tree).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from mtp_jax.config import model_types, parse_config
from mtp_jax.drafts.base import Draft, Rows, StepReads, at_rows, chain_drafts, chained_passes
from mtp_jax.drafts.draft_model.config import DraftModelConfig, parse_draft_model_config
from mtp_jax.errors import ConfigError
from mtp_jax.param_bytes import nbytes
from mtp_jax.targets import target_for
from mtp_jax.targets.base import PagedAttention
from mtp_jax.targets.deepseek_v3.model import TARGET as DEEPSEEK_V3
from mtp_jax.targets.llama.model import TARGET as LLAMA

GROUP = "draft_model"
VOCAB_PADDING = 256
"""How many ids a draft model's vocabulary may differ from the target's by (padding: Qwen2.5's
sizes differ by 128); more means another tokenizer (Llama 3 against DeepSeek-V3: 1024)."""


def _vocab(path: str) -> dict | None:
    """The tokenizer.json vocabulary of a checkpoint directory, when it has one."""
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok):
        return None
    with open(tok, encoding="utf-8") as f:
        return json.load(f).get("model", {}).get("vocab")


def load_draft_model(
    reader: Any,
    raw: dict,
    target_cfg: Any,
    target_params: dict,
    dtype: Any,
    *,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    target_path: str | None = None,
    **_: Any,
) -> tuple[DraftModelConfig, dict]:
    """Read a draft model (any target family's checkpoint) for the target ``target_cfg``. A draft
    whose tokenizer.json differs from the target's (when both have one) is refused: its token ids
    would mean other text."""
    from mtp_jax.checkpoint.formats import checkpoint_format

    path = reader.directory
    cfg = parse_config(raw)
    if target_path is not None and os.path.isdir(target_path):
        mine, theirs = _vocab(path), _vocab(target_path)
        if mine is not None and theirs is not None and mine != theirs:
            raise ConfigError(
                f"{path}: the draft model's tokenizer vocabulary differs from the target's "
                f"({target_path}); a draft model must share the target's vocabulary"
            )
    draft_cfg = DraftModelConfig(cfg, target_cfg.vocab_size)
    _check_plan(draft_cfg, target_cfg, 0)
    tree = checkpoint_format(cfg).load_params(
        reader, cfg, dtype, weights="dense", mtp=False, strict=strict, mesh=mesh
    )
    return draft_cfg, tree


def recognises(raw: dict, reader: Any) -> bool:
    """Whether a draft directory holds a language model mtp-jax loads as a target."""
    return raw.get("model_type") in model_types()


def _check_plan(c: DraftModelConfig, target_cfg: Any, k: int) -> None:
    """The vocabularies must agree up to padding (when loading and when planning)."""
    if abs(c.model.vocab_size - target_cfg.vocab_size) > VOCAB_PADDING:
        raise ConfigError(
            f"the draft model's vocab_size is {c.model.vocab_size}, the target's {target_cfg.vocab_size}: "
            "a draft model must share the target's vocabulary (up to padding)"
        )


def _available(params: dict, cfg: Any) -> str | None:
    if GROUP not in params:
        return "draft='draft_model' needs a draft model loaded beside the target (load(..., draft_model=DIR))"
    return None


def _init_state(ctx, num_pages: int, dtype) -> dict:
    """The draft model's own paged cache (its family's layout) on the target's page ids."""
    c = ctx.draft_cfg.model
    return target_for(c).init_cache(c, num_pages, ctx.page_size, dtype)


def _state_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    family = LLAMA if names[-1:] in (["k"], ["v"]) else DEEPSEEK_V3  # K/V pages, or latent rows
    return tuple(family.cache_logical(names[-1] if names else "", rank))


def _logits(tree: dict, h: jax.Array, ctx) -> jax.Array:
    """Float32 logits over the target's vocabulary from the draft's post-norm states [..., d]: the
    draft model's own head (soft-capped when its family caps logits, as Gemma 3's may)."""
    c, target_vocab = ctx.draft_cfg.model, ctx.draft_cfg.target_vocab_size
    logits = target_for(c).lm_head(tree, h, c)
    v = logits.shape[-1]
    if v >= target_vocab:
        return logits[..., :target_vocab]
    pad = jnp.full((*logits.shape[:-1], target_vocab - v), -jnp.inf, logits.dtype)
    return jnp.concatenate([logits, pad], axis=-1)


def _forward(tree, ctx, pages, page_table, tokens, positions, valid, nodes=None):
    c = ctx.draft_cfg.model
    paged = PagedAttention.at(pages, page_table, positions, valid, ctx.page_size, nodes)
    hidden, pages = target_for(c).forward(tree, c, tokens, positions, paged=paged, mesh=ctx.mesh)
    return hidden.post_norm, pages


def _extend_and_propose(params, ctx, pages, page_table, rows: Rows, active, sampling, first_pos):
    """Read the committed rows and the token after the last one, then chain K drafts."""
    tree = params[GROUP]
    after = at_rows(rows.next_tokens, rows.last)[:, None]
    tokens = jnp.concatenate([rows.tokens, after], axis=1)
    positions = jnp.concatenate([rows.positions, at_rows(rows.positions, rows.last)[:, None] + 1], axis=1)
    valid = jnp.concatenate([rows.valid, at_rows(rows.valid, rows.last)[:, None]], axis=1)
    h, pages = _forward(tree, ctx, pages, page_table, tokens, positions, valid)

    def advance(d, state, pages, position, nodes):  # draft d sits one after the row ``position``
        valid = jnp.broadcast_to(active[:, None], d.shape)
        nodes = None if nodes is None else nodes.moved(1)
        h, pages = _forward(tree, ctx, pages, page_table, d, position + 1, valid, nodes)
        return _logits(tree, h, ctx), state, pages

    return chain_drafts(
        ctx, sampling, first_pos, _logits(tree, h[:, -1], ctx), jnp.zeros((h.shape[0],)), pages, advance
    )


def _teacher_forced(params, ctx, tokens: jax.Array, hidden) -> jax.Array:
    """[b, T-1, V]: the draft model over whole sequences; row i (token i+1 read) predicts i+2."""
    c = ctx.draft_cfg.model
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    h, _ = target_for(c).forward(params[GROUP], c, tokens, positions)
    return _logits(params[GROUP], h.post_norm[:, 1:], ctx)


def _step_reads(params, cfg, draft_cfg, k: int, batch: int, positions: int, cache_itemsize: int) -> StepReads:
    """Every weight once per pass (K passes: the catch-up, K - 1 chained; a MoE draft's routed
    experts counted whole, an upper bound), its embedding rows by the tokens each pass reads, its
    head once per draft, its cache read by every pass."""
    passes = chained_passes(k, batch)
    passes[0] += batch  # the catch-up also reads the token after the last committed row
    weights = heads = 0.0
    tree = params[GROUP]
    for name, sub in tree.items():
        size = sum(nbytes(x) for x in jax.tree.leaves(sub))
        if name == "embed":
            rows = jax.tree.leaves(sub)[0].shape[0]
            weights += size / rows * sum(min(n, rows) for n in passes)
            if "lm_head" not in tree:  # tied: the head reads the embedding
                heads += k * size
        elif name == "lm_head":
            heads += k * size
        else:
            weights += k * size
    c = draft_cfg.model
    kv = k * positions * target_for(c).cache_bytes_per_token(c, cache_itemsize)
    return StepReads(weights, 0.0, heads, float(kv), (), 0)


def _abstract_params(c: DraftModelConfig, shapes) -> dict:
    """The draft model's whole tree as the loader builds it (dense, in the target's dtype), placed
    on the plan's mesh as the draft's own family places it."""
    return shapes.whole_model(c.model)


DRAFT = Draft(
    trees=True,
    name="draft_model",
    available=_available,
    capture=lambda ctx: (),
    init_state=_init_state,
    state_logical=_state_logical,
    extend_and_propose=_extend_and_propose,
    teacher_forced=_teacher_forced,
    step_reads=_step_reads,
    abstract_params=_abstract_params,
    title="draft model",
    params_group=GROUP,
    config_class=DraftModelConfig,
    check_plan=_check_plan,
    recognises=recognises,
    parse_config=parse_draft_model_config,
    load=load_draft_model,
)
