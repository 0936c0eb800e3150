"""Parameter, weight-byte and memory estimates from ``config.json`` alone (no weights are read).

These back ``mtp-jax inspect``, ``mtp-jax convert --dry-run`` and ``mtp-jax plan``'s comparison.
Everything is derived from one enumeration of the hub tensors that each target declares
(:attr:`mtp_jax.targets.base.Target.hub_tensors`: :class:`~mtp_jax.targets.base.HubTensor`,
grouped by shape with a multiplicity, each with the mesh axis that splits it), so the numbers for
DeepSeek-V3 come out in microseconds and stay consistent with each other; no model is named here.
Llama-family models have no routers, experts or MTP and split over the mesh's ``tensor`` axis as
:mod:`mtp_jax.sharding` does.

Conventions (all counts are numbers of scalar parameters, all sizes are bytes; ``GB`` is 10^9 bytes):

* **Norms** hold every RMSNorm weight of the main model: ``input_layernorm``,
  ``post_attention_layernorm``, ``q_a_layernorm``, ``kv_a_layernorm`` of every layer and the final
  ``model.norm``. Attention counts only the projection matrices.
* **Routers** are the MoE gate weights [E, H] plus the float32 ``e_score_correction_bias`` [E].
* **MTP** (``num_nextn_predict_layers``) counts, per nextn layer, a full MoE decoder layer plus
  ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H] and ``shared_head.norm``. The layer's own
  ``embed_tokens`` and ``shared_head.head`` [V, H] are copies of the main embedding / lm_head in the
  hub files; our loader keeps them once, so they are counted apart in ``mtp_duplicates``.
  DeepSeek's published "14B MTP" (671B + 14B = 685B in the model card) *includes* those copies:
  ``mtp + mtp_duplicates`` ≈ 13.5B for DeepSeek-V3, ``mtp`` alone ≈ 11.6B.
* **Active per token** is the main model (no MTP) minus the routed experts, plus
  ``num_experts_per_tok`` routed experts in each MoE layer; the embedding and lm_head are counted in
  full (DeepSeek-V3: ≈ 37.5B, published "37B").
* Byte estimates describe what our loader holds in memory (MTP duplicates stored once, ``kv_b_proj``
  dequantised in FP8 mode, router gates float32) unless ``hub_layout=True`` asks for the hub files'
  size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

from mtp_jax.config import ModelConfig
from mtp_jax.targets import target_for
from mtp_jax.targets.base import HubTensor

WEIGHT_FORMATS = ("bf16", "fp32", "fp8")
MESH_AXES = ("data", "expert", "tensor")
DEFAULT_FP8_BLOCK = (128, 128)
GB = 10**9

COMPONENTS = (
    "embedding",
    "attention",
    "dense_mlp",
    "routers",
    "routed_experts",
    "shared_experts",
    "norms",
    "lm_head",
    "mtp",
    "mtp_duplicates",
)


def _specs(cfg: ModelConfig) -> Iterator[HubTensor]:
    """Every tensor of the hub checkpoint (MTP duplicates under ``mtp_duplicates``), as the
    config's target declares them (:attr:`mtp_jax.targets.base.Target.hub_tensors`)."""
    yield from target_for(cfg).hub_tensors(cfg)


@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Parameter counts (number of scalars) by component; see the module docstring for conventions.

    ``embedding`` .. ``lm_head`` make up the main model (``lm_head`` is 0 when tied). ``mtp`` is all
    nextn layers without their duplicated embed_tokens / shared_head.head, which are
    ``mtp_duplicates``. ``active_per_token`` is what one token touches in the main model.
    """

    embedding: int
    attention: int
    dense_mlp: int
    routers: int
    routed_experts: int
    shared_experts: int
    norms: int
    lm_head: int
    mtp: int
    mtp_duplicates: int
    active_per_token: int

    @property
    def main(self) -> int:
        """Everything except the MTP layers."""
        return (
            self.embedding
            + self.attention
            + self.dense_mlp
            + self.routers
            + self.routed_experts
            + self.shared_experts
            + self.norms
            + self.lm_head
        )

    @property
    def total(self) -> int:
        """Main model plus MTP layers, the duplicated MTP embed/head counted once (as our loader
        stores them)."""
        return self.main + self.mtp

    @property
    def hub_total(self) -> int:
        """Every parameter in the hub files, MTP duplicates included (scales not counted)."""
        return self.total + self.mtp_duplicates

    def components(self) -> dict[str, int]:
        """Component name -> count, in display order."""
        return {name: getattr(self, name) for name in COMPONENTS}


def count_parameters(cfg: ModelConfig) -> ParamCount:
    """Count the parameters of ``cfg`` by component (numbers of scalars, not bytes)."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for s in _specs(cfg):
        counts[s.component] += s.numel
    main = sum(counts[c] for c in COMPONENTS[:8])
    routed = counts["routed_experts"]
    experts, per_token = target_for(cfg).routed_experts(cfg)  # a token touches per_token of them
    active = main - routed + (routed // experts * per_token if experts else routed)
    return ParamCount(**counts, active_per_token=active)


def _check_weights(weights: str, cfg: ModelConfig | None = None) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if weights == "fp8" and cfg is not None and not target_for(cfg).fp8_weights:
        raise ValueError(
            f"weights 'fp8': {target_for(cfg).title} checkpoints are dense (bf16 or fp32); FP8 weights are "
            "for models whose checkpoints ship block-FP8 projections (DeepSeek-V3)"
        )


def stored_format(cfg: ModelConfig, raw: Mapping | None = None) -> str:
    """The weight format a checkpoint stores (what ``mtp-jax convert`` keeps by default): "fp8" for a
    block-FP8 config, else "fp32" when config.json says its ``torch_dtype`` (``dtype``) is float32,
    else "bf16"."""
    if cfg.quantization_config is not None:
        return "fp8"
    dtype = (raw or {}).get("torch_dtype", (raw or {}).get("dtype"))
    return "fp32" if dtype == "float32" else "bf16"


def fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    """The FP8 scale block (rows, cols): the config's ``weight_block_size``, else 128x128."""
    q = cfg.quantization_config
    return q.weight_block_size if q is not None else DEFAULT_FP8_BLOCK


def _spec_bytes(
    s: HubTensor, weights: str, block: tuple[int, int], hub_layout: bool, out: dict[str, int]
) -> None:
    """Add the bytes of ``s`` stored as ``weights`` to ``out`` (dtype name -> bytes)."""

    def add(dtype: str, n: int) -> None:
        out[dtype] = out.get(dtype, 0) + n

    if weights == "fp32" or s.kind == "fp32" or (s.kind == "router" and not hub_layout):
        add("float32", 4 * s.numel)
    elif weights == "bf16" or s.kind in ("plain", "router") or (s.absorbed and not hub_layout):
        add("bfloat16", 2 * s.numel)
    else:  # an FP8-quantised projection: 1 byte per weight + a float32 scale per block
        rows, cols = s.shape
        add("float8_e4m3fn", s.numel)
        add("float32", 4 * math.ceil(rows / block[0]) * math.ceil(cols / block[1]) * s.count)


def weight_bytes(cfg: ModelConfig, weights: str, *, hub_layout: bool = False) -> dict[str, int]:
    """Bytes of all weights (MTP layers included) by storage dtype, e.g.
    ``{"float8_e4m3fn": ..., "float32": ..., "bfloat16": ...}`` (dtypes with 0 bytes are left out).

    ``weights``:

    * ``"fp32"``: everything float32 (4 bytes per parameter).
    * ``"bf16"``: everything bfloat16, except the router ``e_score_correction_bias`` (float32) and,
      as our loader holds it, the router gate (float32: routing is decided in float32; bfloat16 in
      the hub).
    * ``"fp8"``: DeepSeek's block-FP8 layout: every projection matrix is ``float8_e4m3fn`` (1 byte)
      plus float32 ``weight_scale_inv`` of shape [ceil(out/b0), ceil(in/b1)], (b0, b1) from
      ``quantization_config.weight_block_size`` (128x128 when absent); embeddings, lm_head, norms,
      router gates (float32 as loaded), ``eh_proj`` and ``shared_head`` stay bfloat16 and the
      correction bias float32.
      Our loader dequantises ``kv_b_proj`` to bfloat16 (2 bytes, no scales) because it is used in
      absorbed form every step; this estimate does the same unless ``hub_layout``.

    By default the estimate is what our loader holds: the MTP layers' duplicated ``embed_tokens`` /
    ``shared_head.head`` are not counted (stored once). ``hub_layout=True`` gives the size of the
    hub safetensors files instead: duplicates counted and ``kv_b_proj`` quantised like the rest.
    Llama models take "bf16" or "fp32".
    """
    _check_weights(weights, cfg)
    block = fp8_block(cfg)
    out: dict[str, int] = {}
    for s in _specs(cfg):
        if s.component == "mtp_duplicates" and not hub_layout:
            continue
        _spec_bytes(s, weights, block, hub_layout, out)
    order = ("float8_e4m3fn", "bfloat16", "float32")
    return {k: out[k] for k in order if out.get(k)}


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2, include_mtp: bool = True) -> int:
    """Bytes of paged cache one token takes over all layers: DeepSeek-V3's latent row
    (kv_lora_rank + qk_rope_head_dim values per layer, the MTP layers included when
    ``include_mtp``), or Llama's K and V (2 · KV heads · head_dim values per layer): the target's
    :attr:`~mtp_jax.targets.base.Target.cache_bytes_per_token`, plus its own draft's."""
    target = target_for(cfg)
    own = target.own_draft_cache_bytes_per_token(cfg, dtype_bytes) if include_mtp else 0
    return target.cache_bytes_per_token(cfg, dtype_bytes) + own


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Memory one device holds under our sharding plan (all sizes in bytes).

    ``param_bytes``: the parameters replicated on every device; ``expert_bytes``: this device's
    share of the split ones: DeepSeek-V3's ``experts_per_device`` routed experts in every MoE layer
    (MTP layers included, FP8 scales included), Llama's tensor-parallel slices (heads, MLP columns,
    vocabulary of the head); ``kv_bytes``: ``kv_tokens_per_device`` tokens of cache at
    ``kv_bytes_per_token`` each (this device's KV heads).
    """

    mesh: tuple[tuple[str, int], ...]
    devices: int
    experts_per_device: int
    param_bytes: int
    expert_bytes: int
    kv_tokens_per_device: int
    kv_bytes_per_token: int
    kv_bytes: int

    @property
    def weight_bytes(self) -> int:
        return self.param_bytes + self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.expert_bytes + self.kv_bytes

    @property
    def row_shards(self) -> int:
        """Devices holding different rows (and their cache): data x expert; the tensor axis splits
        the same rows' heads."""
        return self.devices // dict(self.mesh)["tensor"]

    def kv_tokens_that_fit(self, device_memory_bytes: int) -> int:
        """KV tokens one device can hold in what its weights leave of ``device_memory_bytes``
        (0 when the weights alone do not fit; no allowance is made for activations/workspace)."""
        free = device_memory_bytes - self.weight_bytes
        return max(free, 0) // self.kv_bytes_per_token if self.kv_bytes_per_token else 0


def _check_mesh(cfg: ModelConfig, mesh: Mapping[str, int]) -> dict[str, int]:
    unknown = sorted(set(mesh) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axes {unknown}; expected a subset of {list(MESH_AXES)}")
    axes = {}
    for name in MESH_AXES:
        size = mesh.get(name, 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis '{name}' must be a positive integer, got {size!r}")
        axes[name] = size
    target_for(cfg).check_axes(cfg, axes)
    return axes


def per_device_memory(
    cfg: ModelConfig,
    weights: str,
    mesh: Mapping[str, int],
    kv_tokens: int,
    *,
    kv_dtype_bytes: int = 2,
    include_mtp: bool = True,
) -> DeviceMemory:
    """Per-device bytes on a ``mesh`` of axes ``data``, ``expert``, ``tensor`` (missing axes are 1;
    devices = their product) under our sharding plan:

    * routed experts split over ``expert``: each device holds n_routed_experts / expert experts of
      every MoE layer (ValueError when ``expert`` does not divide n_routed_experts);
    * every other parameter replicated on every device (data-parallel attention); ``tensor`` must
      be 1 for now (ValueError otherwise);
    * the latent KV cache of ``kv_tokens`` tokens in total split evenly over all data × expert
      devices (DeepSeek-style DP attention), ``kv_dtype_bytes`` bytes per value.

    Weight bytes are as in :func:`weight_bytes` (our loader's layout). ``include_mtp`` counts the
    MTP layers' weights and cache too. Llama: attention heads, MLP columns and the head's
    vocabulary split over ``tensor`` (KV heads too when ``tensor`` divides them, else replicated,
    their cache with them), everything else replicated, the cache's rows split over ``data``.
    """
    _check_weights(weights, cfg)
    axes = _check_mesh(cfg, mesh)
    if kv_tokens < 0:
        raise ValueError(f"kv_tokens must be >= 0, got {kv_tokens}")
    devices = axes["data"] * axes["expert"] * axes["tensor"]
    block = fp8_block(cfg)
    kv_ways = target_for(cfg).cache_split(cfg, axes)
    ways = {"expert": axes["expert"], "tensor": axes["tensor"], "kv_heads": kv_ways}
    replicated: dict[str, int] = {}
    split = {way: {} for way in ways}
    for s in _specs(cfg):
        if s.component == "mtp_duplicates" or (s.component == "mtp" and not include_mtp):
            continue
        _spec_bytes(s, weights, block, False, replicated if s.split is None else split[s.split])
    per_token = kv_cache_bytes_per_token(cfg, kv_dtype_bytes, include_mtp) // kv_ways
    # rows (and their cache) split over data x expert; the tensor axis holds the same rows
    tokens = math.ceil(kv_tokens / (axes["data"] * axes["expert"]))
    return DeviceMemory(
        mesh=tuple(axes.items()),
        devices=devices,
        experts_per_device=target_for(cfg).routed_experts(cfg)[0] // axes["expert"],
        param_bytes=sum(replicated.values()),
        expert_bytes=sum(sum(nbytes.values()) // ways[way] for way, nbytes in split.items()),
        kv_tokens_per_device=tokens,
        kv_bytes_per_token=per_token,
        kv_bytes=tokens * per_token,
    )


def format_count(n: int) -> str:
    """A parameter count as e.g. ``671.03B``, ``926.68M``, ``12.3K`` or ``512``."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    """Bytes in decimal units, e.g. ``688.59 GB`` (1 GB = 10^9 bytes)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _summary(cfg: ModelConfig) -> list[str]:
    target = target_for(cfg)
    if target.describe is not None:
        return target.describe(cfg)
    return [f"Model: {cfg.model_type} ({target.title})"]


def format_report(
    cfg: ModelConfig,
    weights: str,
    mesh: Mapping[str, int],
    kv_tokens: int,
    device_memory_gb: float | None = None,
    *,
    kv_dtype_bytes: int = 2,
) -> str:
    """A readable multi-line report: model summary, parameters by component, weight bytes by dtype
    (as loaded and as in the hub files), per-device memory on ``mesh`` with ``kv_tokens`` KV tokens
    in total and, when ``device_memory_gb`` (10^9 bytes) is given, whether it fits and how many KV
    tokens would fit per device in what the weights leave."""
    _check_weights(weights, cfg)
    pc = count_parameters(cfg)
    mem = per_device_memory(cfg, weights, mesh, kv_tokens, kv_dtype_bytes=kv_dtype_bytes)
    by_expert = target_for(cfg).split_axis == "expert"  # else heads, MLP columns and vocabulary
    split_label = "routed experts" if by_expert else "tensor-split params"
    lines = [*_summary(cfg), "", "Parameters", *_report_parameters(cfg, pc)]
    lines += _report_weight_bytes(cfg, weights)
    lines += _report_memory(mem, kv_tokens, by_expert, split_label)
    if device_memory_gb is not None:
        lines += _report_fit(mem, device_memory_gb)
    return "\n".join(lines)


def _report_parameters(cfg: ModelConfig, pc: ParamCount) -> list[str]:
    labels = {
        "embedding": "embedding",
        "attention": "attention",
        "dense_mlp": "dense MLPs" if pc.routed_experts else "MLPs",
        "routers": "routers",
        "routed_experts": "routed experts",
        "shared_experts": "shared experts",
        "norms": "norms",
        "lm_head": "lm_head" + (" (tied)" if cfg.tie_word_embeddings else ""),
        "mtp": "MTP layers",
        "mtp_duplicates": "MTP embed/head copies",
    }
    if not (pc.routed_experts or pc.mtp):  # a dense model without a draft of its own
        shown = ("embedding", "attention", "dense_mlp", "norms", "lm_head")
        rows = [(labels[k], v) for k, v in pc.components().items() if k in shown]
        rows.append(("total", pc.total))
    else:
        rows = [(labels[k], v) for k, v in pc.components().items()]
        rows[8:8] = [("main (no MTP)", pc.main)]
        rows += [
            ("total (as loaded)", pc.total),
            ("total (hub files)", pc.hub_total),
            ("active per token", pc.active_per_token),
        ]
    return [f"  {name:<24}{format_count(n):>10}" for name, n in rows]


def _report_weight_bytes(cfg: ModelConfig, weights: str) -> list[str]:
    lines = ["", f"Weight bytes ({weights})"]
    loaded, hub = weight_bytes(cfg, weights), weight_bytes(cfg, weights, hub_layout=True)
    lines.append(f"  {'dtype':<16}{'as loaded':>14}{'hub files':>14}")
    for dtype in ("float8_e4m3fn", "bfloat16", "float32"):
        if dtype in loaded or dtype in hub:
            lines.append(
                f"  {dtype:<16}{format_bytes(loaded.get(dtype, 0)):>14}{format_bytes(hub.get(dtype, 0)):>14}"
            )
    lines.append(
        f"  {'total':<16}{format_bytes(sum(loaded.values())):>14}{format_bytes(sum(hub.values())):>14}"
    )
    if weights == "fp8":
        lines.append(
            "  (as loaded: kv_b_proj dequantised to bf16, router gates float32, "
            "MTP embed/head copies stored once)"
        )
    return lines


def _report_memory(mem: DeviceMemory, kv_tokens: int, by_expert: bool, split_label: str) -> list[str]:
    mesh_txt = " ".join(f"{k}={v}" for k, v in mem.mesh)
    return [
        "",
        f"Per-device memory (mesh {mesh_txt}: {mem.devices} devices, "
        + (
            "heads, MLP columns and head vocabulary split over tensor)"
            if not by_expert
            else f"{mem.experts_per_device} routed experts per device per layer)"
        ),
        f"  {'replicated params':<24}{format_bytes(mem.param_bytes):>14}",
        f"  {split_label:<24}{format_bytes(mem.expert_bytes):>14}",
        f"  {'KV cache':<24}{format_bytes(mem.kv_bytes):>14}  ({mem.kv_tokens_per_device} tokens x "
        f"{mem.kv_bytes_per_token} B; {kv_tokens} tokens in total)",
        f"  {'total':<24}{format_bytes(mem.total_bytes):>14}",
    ]


def _report_fit(mem: DeviceMemory, device_memory_gb: float) -> list[str]:
    capacity = int(device_memory_gb * GB)
    fits = mem.total_bytes <= capacity
    verdict = "fits" if fits else "does NOT fit"
    lines = [
        "",
        f"Device memory {device_memory_gb:g} GB: {verdict} ({format_bytes(mem.total_bytes)} needed)",
    ]
    if mem.weight_bytes > capacity:
        lines.append(
            f"  the weights alone ({format_bytes(mem.weight_bytes)}) exceed it: no room for KV cache"
        )
    else:
        fit = mem.kv_tokens_that_fit(capacity)
        lines.append(
            f"  KV tokens that fit beside the weights: {fit} per device, {fit * mem.row_shards} in total "
            f"({format_bytes(capacity - mem.weight_bytes)} free; activations not counted)"
        )
    return lines
