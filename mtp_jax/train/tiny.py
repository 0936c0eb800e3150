"""The pieces of ``scripts/train_tiny.py`` that are not its argument parsing: initial parameters,
the target's next-token objective, held-out evaluation, the card's passages and prompts, greedy
acceptance of a target's own draft, and the atomic write of the trained checkpoint.

The family-specific parts (tiny configurations, initial tensors, model cards) live in the family's
folder (``targets/deepseek_v3/tiny.py``, ``targets/llama/tiny.py``, ``drafts/mtp/card.py``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tokenizers import Tokenizer

from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from mtp_jax.config import ModelConfig
from mtp_jax.drafts.teacher import cross_entropy
from mtp_jax.export import hub_tensors_from_params
from mtp_jax.targets import target_for
from mtp_jax.targets.base import lm_head
from mtp_jax.train.cards import ACCEPTANCE_TOKENS
from mtp_jax.train.data import BOS, EOS
from mtp_jax.train.frozen import acceptance_by_k, load_params

Losses = Callable[[dict, ModelConfig, jax.Array, int], tuple[jax.Array, dict]]


def initial_params(cfg: ModelConfig, config: dict, tensors: dict[str, np.ndarray]) -> dict:
    """Parameters from hub-layout ``tensors``, through the loader (written to a temporary checkpoint)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, config, tensors)
        return load_params(path, cfg)


def target_losses(params: dict, cfg: ModelConfig, window: jax.Array) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy of the target on windows [b, s] predicting window[:, 1:]."""
    inputs = window[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions)
    main = cross_entropy(lm_head(params, hidden.post_norm), window[:, 1:])
    return main, {"loss": main}


def evaluate(
    losses: Losses, params: dict, cfg: ModelConfig, stream: np.ndarray, length: int, count: int, depth: int
) -> dict:
    """Mean held-out ``losses(params, cfg, windows, depth)`` over ``count`` fixed, evenly spaced
    windows (a draft's levels 1..depth)."""
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
    cfg: ModelConfig, params: dict, tok: Tokenizer, texts: list[str], ks: list[int], draft: str
) -> dict:
    """Greedy acceptance length of K drafts of the target's own ``draft`` over the held-out prompts
    (ACCEPTANCE_TOKENS new tokens each)."""
    from mtp_jax.model import Model

    model = Model(cfg, params, dtype="float32", eos_token_ids=[EOS])
    ids = [[BOS, *tok.encode(t, add_special_tokens=False).ids] for t in texts]
    return acceptance_by_k(model, ids, ks, draft, ACCEPTANCE_TOKENS)


def write_checkpoint(
    out: str,
    config: dict,
    cfg: ModelConfig,
    params: dict,
    tok: Tokenizer,
    report: dict,
    held_texts: list[str],
    acceptance_k: list[int],
    card: Callable[[dict, dict], str],
) -> None:
    """Hub layout (bf16), tokenizer, generation config, eval.json and the model card
    (``card(config, report)``), atomically; with the acceptance of the target's own draft when it
    has one."""
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
    own_draft = target_for(cfg).own_draft(cfg)
    if own_draft is not None:
        report["acceptance"] = acceptance_lengths(
            cfg, exported, tok, report["prompts"], acceptance_k, own_draft
        )
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
            f.write(card(config, report))
        write_hub_checkpoint(out, config, tensors, extra_files=files)
