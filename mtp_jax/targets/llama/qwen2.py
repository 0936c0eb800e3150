"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): the Llama family with biases on the q/k/v projections.

Everything else is Llama 3's (:mod:`mtp_jax.targets.llama.model`: GQA, rotate-half rope, RMSNorm,
SwiGLU, tied or untied embeddings); the biases are the layer tree's ``attn.{q,k,v}_bias`` [H or
Hkv, hd], added after the projections, before rope. Its config is
:class:`mtp_jax.targets.llama.config.Qwen2Config`: a checkpoint whose layers attend through a sliding window
(``use_sliding_window``, ``layer_types``) is refused (every layer here attends over the whole
context), as is YaRN rope scaling.
"""

from __future__ import annotations

from mtp_jax.targets.llama.config import Qwen2Config
from mtp_jax.targets.llama.model import family_target

TARGET = family_target("qwen2", Qwen2Config, title="Qwen2")
