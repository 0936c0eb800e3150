"""Qwen3 (``Qwen3ForCausalLM``, dense): the Llama family with an RMSNorm over each query and key
head before rope, and no biases.

Everything else is Llama 3's (:mod:`mtp_jax.targets.llama.model`); the norms are the layer tree's
``attn.{q,k}_norm`` [hd] (epsilon ``rms_norm_eps``), and ``head_dim`` is given explicitly (128 in
the published models, not hidden/heads). Its config is :class:`mtp_jax.targets.llama.config.Qwen3Config`;
``attention_bias`` and sliding windows are refused by name, as are Qwen3's MoE checkpoints
(``qwen3_moe``: another model type).
"""

from __future__ import annotations

from mtp_jax.targets.llama.config import Qwen3Config
from mtp_jax.targets.llama.model import family_target

TARGET = family_target("qwen3", Qwen3Config, title="Qwen3")
