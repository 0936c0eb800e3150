"""A separate draft model's configuration: any target family's config, in the target's vocabulary."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import ModelConfig, parse_config


@dataclasses.dataclass(frozen=True)
class DraftModelConfig:
    """A separate draft model's configuration (:mod:`mtp_jax.drafts.draft_model.draft`): its own parsed
    config (any target family's) and the target's vocabulary size its proposals are in."""

    model: ModelConfig
    target_vocab_size: int


def is_plain_lm(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json is a plain causal language model (e.g. Llama 3.1 8B as a draft for
    70B), not a draft architecture that happens to be written as one."""
    archs = " ".join(map(str, raw.get("architectures") or [])).lower()
    plain = archs.endswith("forcausallm") and "eagle" not in archs and "eagle_config" not in raw
    return plain and "dflash_config" not in raw and "draft_vocab_size" not in raw


def parse_draft_model_config(
    raw: Mapping[str, Any], num_target_layers: int, options: Mapping[str, Any], target_vocab_size: int | None
) -> DraftModelConfig | None:
    """The draft's :attr:`~mtp_jax.drafts.base.Draft.parse_config` hook: a plain causal LM a target
    reads, over ``target_vocab_size`` (default: its own)."""
    if not is_plain_lm(raw):
        return None
    model = parse_config(raw)
    return DraftModelConfig(model, target_vocab_size or model.vocab_size)
