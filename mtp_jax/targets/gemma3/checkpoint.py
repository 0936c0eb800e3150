"""Hub-layout Gemma 3 tensors (``Gemma3ForCausalLM``) -> the parameter pytree of
:mod:`mtp_jax.targets.gemma3.model`: Llama's key map (:mod:`mtp_jax.targets.llama.checkpoint`) with
Gemma's decoder layer (:func:`mtp_jax.targets.gemma3.model.target_layer_leaves`: q/k norms and the
two MLP norms). Norm weights are kept as stored (the forward multiplies by ``1 + w``). Every
published Gemma 3 ties its head to the embedding; an untied checkpoint's ``lm_head.weight`` is read
as Llama's is.
"""

from __future__ import annotations

import functools

from mtp_jax.targets.gemma3.model import target_layer_leaves
from mtp_jax.targets.llama import checkpoint as _llama

STACKED_GROUPS = _llama.STACKED_GROUPS
DRAFT_GROUPS = _llama.DRAFT_GROUPS
group_sizes = _llama.group_sizes
assemble = _llama.assemble
param_groups = functools.partial(_llama.param_groups, leaves=target_layer_leaves)
load_params = functools.partial(_llama.load_params, leaves=target_layer_leaves)
export_tensors = functools.partial(_llama.export_tensors, leaves=target_layer_leaves)
