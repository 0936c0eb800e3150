"""Hub-layout Llama 3 tensors -> the parameter pytree of :mod:`mtp_jax.targets.llama.model`.

Keys: ``model.embed_tokens.weight`` [V, d]; per layer ``model.layers.{i}.`` the tensors
:func:`mtp_jax.targets.llama.model.layer_leaves` declares (``input_layernorm``,
``post_attention_layernorm`` [d], ``self_attn.{q,k,v}_proj.weight`` ([H·hd, d], [Hkv·hd, d],
[Hkv·hd, d]), ``self_attn.o_proj.weight`` [d, H·hd], ``mlp.{gate,up}_proj.weight`` [f, d],
``mlp.down_proj.weight`` [d, f]; Qwen2's ``self_attn.{q,k,v}_proj.bias``, Qwen3's
``self_attn.{q,k}_norm.weight`` [hd]); ``model.norm.weight``; ``lm_head.weight`` [V, d] unless the
embedding is tied. Qwen2 and Qwen3 checkpoints are read by this key map too. The q/k rows of
hub checkpoints are already in the order rotate-half rope expects, so they are used as stored.

Weights are transposed to [in, out] with the head axes split out (q [d, H, hd], o [H, hd, d]) and
the layers stacked (group ``layers``). A tied checkpoint stores no head: the model reads the
embedding (:func:`mtp_jax.targets.base.lm_head`); a ``lm_head.weight`` it does store must then equal
the embedding, or loading stops with an error rather than silently using either one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.hub_layout import as_numpy
from mtp_jax.checkpoint.loader import Group, GroupEmitter, HubTensors, assemble_groups, report_unused
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.errors import CheckpointError
from mtp_jax.targets.llama.config import Llama3Config
from mtp_jax.targets.llama.model import LayerLeaf, layer_leaves, leaves_tree, target_layer_leaves

log = logging.getLogger(__name__)

STACKED_GROUPS = ("layers",)
DRAFT_GROUPS: tuple[str, ...] = ()


def layer_from_leaves(t: HubTensors, pre: str, leaves: tuple[LayerLeaf, ...]) -> dict:
    """One decoder layer's tree under key prefix ``pre``, read as its ``leaves`` declare."""

    def read(leaf: LayerLeaf) -> Any:
        if leaf.kind == "linear":
            return t.linear(pre + leaf.hub, *leaf.hub_shape, leaf.shape)
        return t.get(pre + leaf.hub, leaf.hub_shape).reshape(leaf.shape)

    return leaves_tree(leaves, read)


def decoder_layer_tensors(
    t: HubTensors, pre: str, d: int, h: int, kv: int, hd: int, f: int, d_in: int | None = None
) -> dict:
    """One Llama decoder layer's tensors under key prefix ``pre`` (width d, h query and kv key/value
    heads of hd, MLP width f); the attention projections read inputs of width ``d_in`` (default d;
    an EAGLE-3 draft's read 2d)."""
    return layer_from_leaves(t, pre, layer_leaves(d, h, kv, hd, f, d_in=d_in))


def param_groups(
    reader: CheckpointReader,
    cfg: Llama3Config,
    dtype: Any,
    *,
    weights: str = "dense",
    mtp: bool = True,
    strict: bool = False,
    skip: Mapping[tuple[str, int | None], list[str]] | None = None,
    experts: Any = None,
    leaves: Callable[[Any], tuple[LayerLeaf, ...]] = target_layer_leaves,
) -> Iterator[tuple[Group, list[str]]]:
    """Yield ((name, index, host pytree), hub keys consumed) one group at a time: ``embed``, each
    of ``layers``, ``final_norm`` and (untied) ``lm_head``. ``dtype`` None keeps each tensor's
    stored dtype. ``skip`` as in :class:`mtp_jax.checkpoint.loader.GroupEmitter`; ``weights``,
    ``mtp`` and ``experts`` are accepted for a uniform signature and mean nothing here. Tensors
    nobody asked for are reported at the end (an error with ``strict``). ``leaves(cfg)``: the
    decoder layer's tensors (another family of the same layout, Gemma 3, passes its own)."""
    if weights != "dense":
        raise CheckpointError(f"weights={weights!r}: {cfg.model_type} checkpoints are dense (BF16/FP16/FP32)")
    t = HubTensors(reader, cfg, dtype, weights)
    d, v = cfg.hidden_size, cfg.vocab_size
    emit = GroupEmitter(t, skip)
    layer_leaves_ = leaves(cfg)
    yield emit("embed", None, lambda: t.get("model.embed_tokens.weight", (v, d)))
    for i in range(cfg.num_hidden_layers):
        yield emit("layers", i, lambda i=i: layer_from_leaves(t, f"model.layers.{i}.", layer_leaves_))
    yield emit("final_norm", None, lambda: t.get("model.norm.weight", (d,)))
    if not cfg.tie_word_embeddings:
        yield emit("lm_head", None, lambda: np.ascontiguousarray(t.linear("lm_head.weight", v, d)))
    elif "lm_head.weight" in reader:
        if not t.same("lm_head.weight", "model.embed_tokens.weight"):
            raise CheckpointError(
                f"{reader.directory}: config.json ties the embeddings (tie_word_embeddings=true) but the "
                "checkpoint's lm_head.weight differs from model.embed_tokens.weight"
            )
        emit.used.add("lm_head.weight")  # a stored copy of the tied head: read once, as the embedding
    report_unused(reader, emit.used, strict=strict, logger=log)


def group_sizes(cfg: Llama3Config, mtp: bool = True) -> dict[str, int]:
    return {"layers": cfg.num_hidden_layers}


def assemble(
    groups: Iterator[Group],
    cfg: Llama3Config,
    dtype: Any = None,
    *,
    mtp: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Device parameters from groups; a tied model gets no ``lm_head`` (the head reads ``embed``)."""
    return assemble_groups(groups, group_sizes(cfg), mesh=mesh, copy_tied_head=False)


def load_params(
    reader: CheckpointReader,
    cfg: Llama3Config,
    dtype: Any,
    *,
    weights: str = "dense",
    mtp: bool = True,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    leaves: Callable[[Any], tuple[LayerLeaf, ...]] = target_layer_leaves,
) -> dict:
    """Read a hub Llama 3 checkpoint into device parameters (with a mesh, each leaf placed with its
    sharding as it is read)."""
    groups = (g for g, _ in param_groups(reader, cfg, dtype, weights=weights, strict=strict, leaves=leaves))
    return assemble(groups, cfg, dtype, mesh=mesh)


def export_tensors(
    params: dict,
    cfg: Llama3Config,
    dtype: np.dtype,
    leaves: Callable[[Any], tuple[LayerLeaf, ...]] | None = None,
) -> dict[str, np.ndarray]:
    """The inverse of :func:`param_groups`: ``params`` (host arrays) as hub tensors in ``dtype``
    (no ``lm_head.weight`` when the embedding is tied). ``leaves(cfg)``: as for
    :func:`param_groups` (None: a Llama-family layer's, read off its shapes)."""
    t = {"model.embed_tokens.weight": as_numpy(params["embed"], dtype)}
    for i in range(cfg.num_hidden_layers):
        layer = jax.tree.map(lambda x, i=i: x[i], params["layers"])
        t.update(
            llama_layer_tensors(layer, f"model.layers.{i}.", dtype, None if leaves is None else leaves(cfg))
        )
    t["model.norm.weight"] = as_numpy(params["final_norm"], dtype)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = np.ascontiguousarray(as_numpy(params["lm_head"], dtype).T)
    return t


def llama_layer_tensors(
    p: dict, pre: str, dtype: np.dtype, leaves: tuple[LayerLeaf, ...] | None = None
) -> dict[str, np.ndarray]:
    """One Llama-family layer's hub tensors, as :func:`mtp_jax.targets.llama.model.layer_leaves`
    declares them for the layer's own shapes and extras (biases, q/k norms), or as ``leaves``
    declare them."""
    if leaves is None:
        a = p["attn"]
        d_in, h, hd = np.shape(a["q"])
        d, f = np.shape(p["mlp"]["gate"])
        leaves = layer_leaves(
            d, h, np.shape(a["k"])[1], hd, f, d_in=d_in, qkv_bias="q_bias" in a, qk_norm="q_norm" in a
        )
    t = {}
    for leaf in leaves:
        x = p
        for name in leaf.path:
            x = x[name]
        x = as_numpy(x, dtype)
        if leaf.kind == "linear":  # ours is the hub's [out, in] transposed, reshaped
            x = x.reshape(leaf.hub_shape[::-1]).T
        t[pre + leaf.hub] = np.ascontiguousarray(x.reshape(leaf.hub_shape))
    return t
