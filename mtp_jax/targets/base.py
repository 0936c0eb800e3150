"""What every target model supplies to the unified step, the engine and the tools.

A target is the model a speculative step verifies with (DeepSeek-V3, Llama 3). Each target module
builds one :class:`Target`: a frozen table of its functions, looked up from a config's type by
:func:`mtp_jax.targets.target_for`. The step, the engine, prefill, the host-orchestrated baseline,
``plan``, ``roofline`` and the benchmarks only ever call these functions, so any target runs with
any draft (:mod:`mtp_jax.drafts`) without per-pair code.

Conventions every target follows:

- parameters: a dict pytree with ``embed`` [V, d], ``final_norm`` [d] and ``lm_head`` [d, V]
  (absent when the embedding is tied: the head then reads ``embed``), plus its layer stacks;
- KV cache: a dict of arrays whose leaves are [L, P, page, ...] (a stack of L layers, P pages of
  ``page`` positions each): :attr:`Target.cache_logical` names the axes for sharding;
- captured layers: layer i means the OUTPUT of decoder layer i (0-based), i.e. transformers'
  ``hidden_states[i + 1]``; layer -1 is the embedding output (the input of layer 0). A forward
  collects them with :class:`CapturePlan`;
- layer stacks: a tree whose leaves are [n, ...] (as loaded), run with ``lax.scan``, or a tuple of
  n per-layer trees (:func:`unstack_layers`), run as n unrolled layers. A forward runs either with
  :func:`scan_layers`. A scan slices every layer's weights out of the stack each step, and XLA
  copies each slice (on an H100, half of a Llama 3.1 8B decode step; on a CPU, a quarter of a
  SmolLM2-sized one); per-layer buffers are read in place, at the price of compiling each layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache import slots_for


def scan_layers(
    layer: Callable[[Any, tuple], tuple[Any, Any]], carry: Any, stack: Any, *xs: np.ndarray
) -> tuple[Any, Any]:
    """``lax.scan(layer, carry, (stack, *xs))`` over a stacked layer tree, or, when ``stack`` is a
    tuple of per-layer trees, the same layers unrolled: ``layer(carry, (stack[i], x[i], ...))``
    with each ``x[i]`` a static numpy scalar, the per-layer outputs stacked (None stays None).
    ``xs``: numpy arrays [n] (layer indices, capture slots)."""
    if not isinstance(stack, tuple):
        return jax.lax.scan(layer, carry, (stack, *(jnp.asarray(x) for x in xs)))
    ys = []
    for i, p in enumerate(stack):
        carry, y = layer(carry, (p, *(x[i] for x in xs)))
        ys.append(y)
    if not ys or ys[0] is None:
        return carry, None
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def lora_stack(stack: Any, params: dict, group: str) -> Any:
    """The layer stack of ``group`` for :func:`scan_layers`, paired with its LoRA stacks (leaves
    [L, S, ...] in ``params["lora"][group]``) when the model has adapters: each layer then reads
    ``{"w": its weights, "lora": its adapters' slots}`` (unpacked by :func:`with_lora`)."""
    lora = params.get("lora", {}).get(group)
    if lora is None:
        return stack
    if isinstance(stack, tuple):  # per-layer buffers, the adapters' too (else sliced: copied)
        layers = (
            lora
            if isinstance(lora, tuple)
            else [jax.tree.map(lambda x, i=i: x[i], lora) for i in range(len(stack))]
        )
        return tuple({"w": p, "lora": one} for p, one in zip(stack, layers, strict=True))
    return {"w": stack, "lora": lora}


def with_lora(p: Any, slots: jax.Array | None) -> dict:
    """One layer's weights for a forward: ``p`` as :func:`lora_stack` gave it, with each adapted
    sub-tree (``attn``, ``mlp``, ...) given a ``"lora"`` entry: its projections' adapter slots
    ({"a": [*in, S, R], "b": [S, R, *out]} each) and ``"rows"``, the rows' ``slots`` [b] one-hot
    [b, S] (:func:`mtp_jax.lora.delta`)."""
    if not (isinstance(p, dict) and "w" in p and "lora" in p and len(p) == 2):
        return p
    w, lora = p["w"], p["lora"]
    if slots is None:
        return w
    count = next(x.shape[0] for path, x in jax.tree_util.tree_leaves_with_path(lora) if path[-1].key == "b")
    rows = jax.nn.one_hot(slots - 1, count, dtype=jnp.float32)  # slot 0 (no adapter): all zeros
    return {**w, **{name: {**w[name], "lora": {**lora[name], "rows": rows}} for name in lora}}


def unstack_layers(stack: Any, consume: bool = False) -> tuple:
    """A stacked layer tree (leaves [n, ...]) as a tuple of n per-layer trees, each leaf its own
    buffer (FP8 weights stay FP8 with their scales); see :func:`scan_layers`. ``consume``: delete
    each stacked leaf once it is split (the caller must hold no other use of ``stack``), so the
    conversion needs room for one more leaf instead of a second copy of every layer."""
    leaves, tree = jax.tree.flatten(stack)
    n = leaves[0].shape[0]
    split = []
    for x in leaves:
        split.append([x[i] for i in range(n)])
        if consume and isinstance(x, jax.Array):
            x.delete()
    return tuple(jax.tree.unflatten(tree, [parts[i] for parts in split]) for i in range(n))


class Hidden(NamedTuple):
    """Hidden states of a forward pass, all [b, t, d] (``layers``: [n_captured, b, t, d])."""

    post_norm: jax.Array
    pre_norm: jax.Array
    layers: jax.Array | None
    expert_load: jax.Array | None = None
    """Tokens routed to each expert of each MoE layer [n_moe_layers, e] (None without MoE layers)."""


class TreeMask(NamedTuple):
    """Tree attention for tokens of a token tree (:mod:`mtp_jax.tree`), whose nodes sit in a row's
    cache at consecutive positions ``base`` .. ``base + N - 1`` in node order while their rotary
    positions are ``base + depth``: each token is written at, and sees keys up to, its cache
    position ``positions`` [b, t], and of the tree's positions only those ``nodes`` [b, t, N] marks
    (its own node and its ancestors). ``base`` [b]."""

    positions: jax.Array
    base: jax.Array
    nodes: jax.Array

    def moved(self, by: int) -> TreeMask:
        """The same tree ``by`` cache positions further on (a draft whose cache entry for a token
        sits at the token's own position rather than the row before it)."""
        return TreeMask(self.positions + by, self.base + by, self.nodes)


class PagedAttention(NamedTuple):
    """Where a forward pass reads and writes its paged KV cache.

    pages: the target's cache dict (leaves [L, P, page, ...]), or one layer's pages for a draft;
    slots: flat cache slot [b, t] of each new token (>= P·page: not written);
    page_table: [b, n] page ids of each row, in position order;
    tree: a token tree's attention (:class:`TreeMask`; the tokens' ``positions`` are then rotary
    positions only), or None: causal by position;
    ring_table: [b, n] each row's page table into a sliding-window layers' ring
    (:func:`mtp_jax.cache.ring_table`; a cache made by :attr:`Target.init_ring_cache`), else None;
    valid: [b, t] which new tokens are written (with ``ring_table``: its own slots come from it).
    """

    pages: Any
    slots: jax.Array
    page_table: jax.Array
    tree: TreeMask | None = None
    ring_table: jax.Array | None = None
    valid: jax.Array | None = None

    @classmethod
    def at(
        cls,
        pages: Any,
        page_table: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
        page_size: int,
        tree: TreeMask | None = None,
        ring_table: jax.Array | None = None,
        ring_valid: jax.Array | None = None,
    ) -> PagedAttention:
        """New tokens at ``positions`` [b, t] (written where ``valid``) of rows with ``page_table``,
        or, with ``tree``, at the tree's cache positions under its tree attention; ``ring_table``:
        the rows' table into a sliding-window ring (:attr:`Target.init_ring_cache`), written where
        ``ring_valid`` (default ``valid``: a prompt's tokens recomputed after a cached prefix fill
        the ring and are not written over the prefix's shared pages)."""
        written = positions if tree is None else tree.positions
        slots = slots_for(page_table, written, valid, page_size)
        if ring_table is None:
            return cls(pages, slots, page_table, tree)
        return cls(pages, slots, page_table, tree, ring_table, valid if ring_valid is None else ring_valid)

    def written(self, positions: jax.Array) -> jax.Array:
        """The cache positions [b, t] the tokens at rotary ``positions`` are written at."""
        return positions if self.tree is None else self.tree.positions

    def attention(self, positions: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """(the positions attention masks by, the tree mask (base, nodes) or None) for tokens at
        rotary ``positions`` [b, t]."""
        if self.tree is None:
            return positions, None
        return self.tree.positions, (self.tree.base, self.tree.nodes)


def head_logits(head: jax.Array, h: jax.Array) -> jax.Array:
    """Float32 logits [..., V] of an output head stored [d, V] over states h [..., d] (the target's
    untied head, a draft's own)."""
    return jnp.einsum("...d,dv->...v", h, head, preferred_element_type=jnp.float32)


def lm_head(params: dict, h: jax.Array) -> jax.Array:
    """Float32 logits [..., V] from post-norm hidden states [..., d]: ``lm_head`` [d, V], or the
    embedding [V, d] itself when the model ties them (no transposed copy is made)."""
    if "lm_head" in params:
        return head_logits(params["lm_head"], h)
    return jnp.einsum("...d,vd->...v", h, params["embed"], preferred_element_type=jnp.float32)


def head_columns(params: dict, ids: Any) -> np.ndarray:
    """The output head's columns for target ids ``ids`` [Vd], as a host array [d, Vd] (``lm_head``
    [d, V], or rows of a tied embedding [V, d] transposed): a draft head over a draft vocabulary
    that is exactly the target's there. A head sharded across hosts is gathered replicated first."""
    tied = "lm_head" not in params
    head = params["embed"] if tied else params["lm_head"]
    axis = 0 if tied else 1

    def take(w: jax.Array) -> jax.Array:
        return jnp.take(w, jnp.asarray(ids), axis=axis)

    if isinstance(head, jax.Array) and not head.is_fully_addressable:
        replicated = jax.sharding.NamedSharding(head.sharding.mesh, jax.sharding.PartitionSpec())
        cols = jax.jit(take, out_shardings=replicated)(head)
    else:
        cols = take(head)
    cols = np.asarray(cols)
    return np.ascontiguousarray(cols.T if tied else cols)


def check_capture(num_layers: int, capture: tuple[int, ...]) -> None:
    for i in capture:
        if not -1 <= i < num_layers:
            raise ValueError(
                f"captured layer {i} is outside [-1, {num_layers}) (layer i: the output of decoder layer i; "
                "-1: the embedding)"
            )


class CapturePlan:
    """How a scanned forward collects the outputs of layers ``capture`` (static; any order,
    repeats allowed, -1 = the embedding output) in one buffer riding in the scan's carry.

    ``start(h)`` makes the buffer [n_distinct + 1, ...h.shape] (the last slot is scratch for the
    layers nobody asked for) with the embedding already stored when asked; layer i writes its
    output to slot ``slot_of[i]``; ``finish(buffer)`` returns [len(capture), ...] in the asked order.
    """

    def __init__(self, num_layers: int, capture: tuple[int, ...]) -> None:
        check_capture(num_layers, capture)
        self.capture = tuple(capture)
        self.distinct = sorted(set(capture))
        self.slot_of = np.full(num_layers, len(self.distinct), np.int32)
        for slot, layer in enumerate(self.distinct):
            if layer >= 0:
                self.slot_of[layer] = slot

    def start(self, h: jax.Array) -> jax.Array | None:
        if not self.capture:
            return None
        buffer = jnp.zeros((len(self.distinct) + 1,) + h.shape, h.dtype)
        return buffer.at[0].set(h) if self.distinct[0] == -1 else buffer

    def finish(self, buffer: jax.Array | None) -> jax.Array | None:
        if buffer is None:
            return None
        order = [self.distinct.index(i) for i in self.capture]
        return buffer[np.asarray(order)] if order != list(range(len(order))) else buffer[: len(order)]


@dataclasses.dataclass(frozen=True)
class HubTensor:
    """``count`` tensors of one shape in a model's hub checkpoint, as the size estimates
    (:mod:`mtp_jax.estimate`: ``mtp-jax inspect``, ``convert --dry-run``, ``plan``) count
    them. ``shape``: (out, in) for a matrix, (n,) for a vector; ``kind``: how it is stored:
    ``linear`` (a projection, FP8 with block scales in an FP8 checkpoint), ``plain`` (never
    quantised: embeddings, heads, norms, biases), ``fp32`` (float32 in every format: DeepSeek's
    router correction bias) or ``router`` (bfloat16 in the hub, float32 as loaded); ``component``:
    its part of the model (:data:`mtp_jax.estimate.COMPONENTS`); ``split``: the mesh
    axis that splits it (``expert``, ``tensor``, or ``kv_heads``: over ``tensor`` when that divides
    the KV heads); ``absorbed``: a projection the loader keeps dense even in FP8 mode."""

    component: str
    shape: tuple[int, ...]
    count: int
    kind: str
    split: str | None = None
    absorbed: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count


def _no_tensors(cfg: Any) -> Iterable[HubTensor]:
    raise NotImplementedError(
        f"no size estimate for {type(cfg).__name__}: its target declares no hub_tensors"
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """A target model's functions (each module builds one; see the module docstring).

    forward(params, cfg, tokens [b, t], positions [b, t], paged=None, capture=(), mesh=None)
        -> (Hidden, cache or None): teacher-forced over whole sequences without ``paged``; with it,
        writes the tokens' KV at ``paged.slots`` and attends over the paged cache.
    init_cache(cfg, num_pages, page_size, dtype) -> zeroed cache dict.
    cache_logical(name, rank) -> logical axis names of the cache leaf ``name`` (None = replicated).
    cache_bytes_per_token(cfg, itemsize) -> bytes one token occupies in the cache, all layers.
    check_mesh(cfg, mesh) -> None, or ValueError when the mesh cannot split this model.
    layer_stacks(cfg) -> names of the parameter groups holding its layer stacks.
    layer_leaves(cfg) -> the declared tensors of one decoder layer (Llama family:
    :class:`mtp_jax.targets.llama.model.LayerLeaf`), from which the tools derive its tree; None when
    its layers differ by kind and the family's own key map and ``abstract_groups`` read its
    declarations (DeepSeek-V3: :func:`mtp_jax.targets.deepseek_v3.model.layer_leaves` per dense or
    MoE layer).
    """

    name: str
    config_class: type
    forward: Callable[..., tuple[Hidden, Any]]
    init_cache: Callable[..., dict]
    cache_logical: Callable[[str, int], tuple[str | None, ...]]
    cache_bytes_per_token: Callable[[Any, int], int]
    check_mesh: Callable[[Any, Any], None]
    layer_stacks: Callable[[Any], tuple[str, ...]] = lambda cfg: ()
    """The parameter groups that are stacked layer trees run by :func:`scan_layers`."""
    layer_leaves: Callable[[Any], tuple] | None = None
    title: str = ""
    """The model family's name for people ("Llama 3", "Qwen2")."""
    split_axis: str = "tensor"
    """The mesh axis its weights are split over when one device cannot hold them ("tensor": heads,
    MLP columns and the vocabulary; "expert": routed experts), the tools' default mesh."""
    fp8_weights: bool = False
    """Whether its checkpoints come with FP8 projections (kept FP8 with block scales)."""
    own_draft: Callable[[Any], str | None] = lambda cfg: None
    """``own_draft(cfg)``: the registered draft whose weights come in the target's own checkpoint
    (DeepSeek-V3's MTP layer: "mtp"), what the tools plan and time when no other draft is named;
    None when the checkpoint has none."""

    hub_tensors: Callable[[Any], Iterable[HubTensor]] = _no_tensors
    """``hub_tensors(cfg)``: every tensor of its hub checkpoint (:class:`HubTensor`; those of the
    draft in the same checkpoint under the ``mtp`` components), from which the size estimates are
    derived."""
    routed_experts: Callable[[Any], tuple[int, int]] = lambda cfg: (0, 0)
    """``routed_experts(cfg) -> (experts per MoE layer, experts each token is routed to)``; (0, 0)
    for a dense model (the roofline's expected expert reads, the per-device estimate)."""
    check_axes: Callable[[Any, Mapping[str, int]], None] = lambda cfg, axes: None
    """``check_axes(cfg, {"data": n, "expert": n, "tensor": n})``: ValueError naming the axis when
    mesh axes of those sizes cannot split this model (the estimates' and ``plan``'s check; the
    step's is :attr:`check_mesh`)."""
    cache_split: Callable[[Any, Mapping[str, int]], int] = lambda cfg, axes: 1
    """``cache_split(cfg, axes)``: how many ways each token's cache is split over the mesh's
    ``tensor`` axis (the KV heads, when it divides them); its rows split over data x expert."""
    own_draft_cache_bytes_per_token: Callable[[Any, int], int] = lambda cfg, itemsize: 0
    """Bytes one token takes in the cache of :attr:`own_draft` (DeepSeek-V3's MTP layers)."""
    abstract_groups: Callable[[Any, Any, bool], dict] | None = None
    """``abstract_groups(cfg, shapes, own_draft) -> {group: tree}``: its parameter groups (one layer
    for a layer stack) as the loader builds them, as ShapeDtypeStructs made with ``shapes``
    (:mod:`mtp_jax.plan`'s builder: ``plain(*shape, dtype=None)``, ``linear(out, in, shape)``,
    which is FP8 when FP8 weights are planned, ``stacked(tree, n)``); ``own_draft``: with the
    group of :attr:`own_draft`'s weights. For ``mtp-jax plan`` and random-weight timings."""
    lora_sites: Callable[[Any], tuple] = lambda cfg: ()
    """``lora_sites(cfg)``: the projections that take LoRA adapters (:class:`mtp_jax.lora.LoraSite`;
    empty: adapters are refused). Its ``forward`` then takes ``lora_slots`` [b] and applies the rows'
    adapters from ``params["lora"]`` (:func:`with_lora`)."""
    describe: Callable[[Any], list[str]] | None = None
    """``describe(cfg)``: lines summing the architecture up for ``mtp-jax inspect`` (None: its
    model type and title)."""
    norm_scale: Callable[[Any], Any] = lambda weight: weight
    """``norm_scale(weight)``: the per-channel factor one of its RMSNorm weights multiplies by, as
    stored in its parameters (Gemma's stored w: 1 + w), for a draft whose plain RMSNorm starts from
    the target's."""
    logit_softcap: Callable[[Any], float | None] = lambda cfg: None
    """``logit_softcap(cfg)``: c when the target's logits are soft-capped, ``c * tanh(logits / c)``
    (Gemma's ``final_logit_softcapping``); None: raw."""
    sliding_window: Callable[[Any], int | None] = lambda cfg: None
    """``sliding_window(cfg)``: how many positions its sliding-window layers see (each query the
    last ``window`` keys, itself included); None when every layer attends globally."""
    init_ring_cache: Callable[..., dict] | None = None
    """``init_ring_cache(cfg, num_pages, ring_pages, page_size, dtype)``: a zeroed cache whose
    sliding-window layers keep their keys and values in a pool of ``ring_pages`` pages (each slot's
    ring, :func:`mtp_jax.cache.ring_table`) and whose other layers keep ``num_pages`` as
    :attr:`init_cache` does; its ``forward`` then reads :attr:`PagedAttention.ring_table`. None: no
    ring (every layer keeps every page)."""

    def lm_head(self, params: dict, h: jax.Array, cfg: Any) -> jax.Array:
        """The target's float32 logits [..., V] from post-norm states ``h`` [..., d] of a model of
        config ``cfg``: :func:`lm_head`, soft-capped when :attr:`logit_softcap` says so."""
        logits = lm_head(params, h)
        cap = self.logit_softcap(cfg)
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def initial_hub_tensors(
    shapes: Mapping[str, tuple[int, ...]], seed: int, depth: int
) -> dict[str, np.ndarray]:
    """Initial weights for training from scratch, by hub name: N(0, 0.02) projections (output
    projections ``o_proj``/``down_proj`` scaled by 1/sqrt(2·depth), GPT-2's rule for ``depth``
    residual layers), unit norms, zero router correction biases; drawn in name order from ``seed``."""
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / math.sqrt(2 * depth)
    tensors = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = np.ones(shape, np.float32)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = np.zeros(shape, np.float32)
        else:
            std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
            tensors[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return tensors
