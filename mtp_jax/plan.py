"""``mtp-jax plan``: lower and compile the unified step at full size without the hardware.

The parameters and the decode state exist only as abstract shapes (``jax.ShapeDtypeStruct`` with
the shardings :func:`mtp_jax.load` and the engine would give them), so no weight is allocated: a
671B-parameter DeepSeek-V3 plans on a laptop. XLA compiles the jitted :func:`mtp_jax.step.step`
(and optionally :func:`mtp_jax.step.prefill`) for a mesh of simulated host devices and reports, per
device, what its buffer assignment needs: arguments (split here into parameters, KV cache and the
rest of the state from the abstract shardings), outputs, aliasing with the donated state,
temporaries and generated code, plus the time lowering and compiling took.

Caveats: the program is compiled by XLA:CPU unless the default backend itself has enough devices.
Its temporaries are those of the CPU lowering (e.g. ``ragged_dot`` runs as a masked dense matmul,
FP8 weights are dequantised layer by layer into bfloat16 temporaries); a GPU build fuses
differently. Parameters, cache and the donated-state aliasing do not depend on the backend.

Simulated devices need ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` before JAX
creates its CPU backend: :func:`request_host_devices` sets it, and the CLI re-runs itself in a
child process when JAX was initialised with too few devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mtp_jax.checkpoint.formats import checkpoint_format
from mtp_jax.config import ModelConfig
from mtp_jax.drafts import DRAFTS, draft_for, draft_for_config
from mtp_jax.estimate import GB, _check_mesh, format_bytes, fp8_block, per_device_memory
from mtp_jax.fp8 import Fp8Weight
from mtp_jax.sharding import group_shardings, make_mesh, row_shards, state_shardings
from mtp_jax.targets import target_for

PLAN_WEIGHTS = ("fp8", "bf16")
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CPU_DISABLED_PASSES = ("while-loop-invariant-code-motion",)
"""XLA passes turned off when compiling for the CPU backend. XLA:CPU has no FP8 arithmetic, so it
rewrites each FP8 dequantisation to go through float16, and loop-invariant code motion then hoists
that convert of the whole stacked [L, E, in, out] FP8 weights out of the layer scan: a float16 copy
of every routed expert (about 196 GB per device for DeepSeek-V3 on 8 devices) that a GPU/TPU build,
which converts one layer's slice inside the loop, never makes."""
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
)


# --- simulated devices --------------------------------------------------------------------------
def with_device_count(xla_flags: str, n: int) -> str:
    """``xla_flags`` with the forced host device count set to ``n`` (an existing count replaced)."""
    rest = re.sub(rf"\s*{DEVICE_COUNT_FLAG}=\S+", "", xla_flags).strip()
    return f"{rest} {DEVICE_COUNT_FLAG}={n}".strip()


def request_host_devices(n: int) -> bool:
    """Make ``n`` devices available for a mesh: set ``XLA_FLAGS`` so the CPU backend simulates ``n``
    devices (effective only if JAX has not created it yet), then check. Returns whether ``n``
    devices of the default backend or of the CPU backend exist; False means JAX was initialised
    earlier with fewer, and only a fresh process (with the updated ``os.environ``) can have them."""
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)
    return len(jax.devices()) >= n or len(jax.devices("cpu")) >= n


def plan_devices(n: int) -> list[jax.Device]:
    """``n`` devices for the plan's mesh: the default backend's when it has enough, else the CPU's."""
    devices = jax.devices() if len(jax.devices()) >= n else jax.devices("cpu")
    if len(devices) < n:
        raise RuntimeError(
            f"the mesh needs {n} devices but only {len(devices)} exist; start the process with "
            f"XLA_FLAGS={DEVICE_COUNT_FLAG}={n} (mtp-jax plan does this itself)"
        )
    return devices[:n]


# --- abstract parameters ------------------------------------------------------------------------
class _AbstractParams:
    """The builder a target's :attr:`~mtp_jax.targets.base.Target.abstract_groups` and a draft's
    ``abstract_params`` make the loader's parameter pytree with, as ShapeDtypeStructs: ``plain``
    tensors in the planned dtype, ``linear`` projections (with ``fp8``, a hub-FP8 projection kept
    as an :class:`Fp8Weight` with its block scales), ``stacked`` trees, a ``dense`` builder for
    another config's tensors and a ``whole_model`` (a draft that is a model of its own)."""

    def __init__(self, cfg: ModelConfig, dtype: Any, fp8: bool, mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.fp8 = fp8
        self.mesh = mesh
        """The mesh the parameters are planned on (a draft that is a whole model places its own)."""
        self.block = fp8_block(cfg)  # hub orientation (out rows, in cols)

    def whole_model(self, cfg: ModelConfig) -> dict:
        """Another model's whole parameter tree (dense, this dtype, its MTP layer left out) placed
        on this mesh as its own family places it: a draft that is a whole model."""
        return abstract_params(cfg, self.mesh, self.dtype, weights="bf16", mtp=False)

    def plain(self, *shape: int, dtype: Any = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype or self.dtype))

    def linear(self, out_dim: int, in_dim: int, shape: tuple[int, ...] | None = None) -> Any:
        """A hub-FP8 projection [out, in] as the loader keeps it: [in, out] reshaped to ``shape``."""
        shape = shape or (in_dim, out_dim)
        if not self.fp8:
            return self.plain(*shape)
        b_out, b_in = self.block
        return Fp8Weight(
            w=jax.ShapeDtypeStruct((in_dim, out_dim), jnp.float8_e4m3fn),
            scale_inv=jax.ShapeDtypeStruct(
                (math.ceil(in_dim / b_in), math.ceil(out_dim / b_out)), jnp.float32
            ),
            shape=shape,
            block=(b_in, b_out),
        )

    def dense(self, cfg: ModelConfig) -> _AbstractParams:
        """This builder for ``cfg``'s tensors, every projection dense in this dtype (drafts are
        published in bf16, whatever the target stores)."""
        return _AbstractParams(cfg, self.dtype, False, self.mesh)

    def stacked(self, tree: Any, n: int) -> Any:
        """``tree``'s leaves with a leading layer axis of ``n``."""
        return jax.tree.map(lambda s: _stacked(s, n), tree)

    def groups(self, own_draft: bool) -> dict[str, Any]:
        """Group name -> the tree of one group (one layer for the stacked groups), as the target
        declares them (:attr:`mtp_jax.targets.base.Target.abstract_groups`)."""
        target = target_for(self.cfg)
        if target.abstract_groups is None:
            raise ValueError(
                f"{target.title or target.name} declares no abstract parameters: it cannot be planned"
            )
        return target.abstract_groups(self.cfg, self, own_draft)


def _stacked(s: jax.ShapeDtypeStruct, n: int, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((n,) + tuple(s.shape), s.dtype, sharding=sharding)


def abstract_params(
    cfg: ModelConfig,
    mesh: Mesh,
    dtype: Any = jnp.bfloat16,
    *,
    weights: str = "fp8",
    mtp: bool = True,
    draft_cfg: Any = None,
) -> dict:
    """The parameter pytree of ``mtp_jax.load(..., dtype, weights=, mtp=, mesh=mesh)`` as
    ShapeDtypeStructs carrying the loader's shardings (:func:`mtp_jax.sharding.group_shardings`):
    same structure, shapes and dtypes, nothing allocated. ``weights``: "fp8" (the hub's FP8
    projections kept FP8 with their block scales; blocks from ``quantization_config``, 128x128 when
    the config has none) or "bf16" (everything dense in ``dtype``). Routers stay float32.
    ``draft_cfg``: a draft loaded beside the target (``load(..., draft_model=)``; an EAGLE-3 or
    DFlash config with its captured layers resolved), added as its group from the tree the draft
    declares (``Draft.abstract_params``)."""
    if weights not in PLAN_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(PLAN_WEIGHTS)}, got {weights!r}")
    if weights == "fp8" and not target_for(cfg).fp8_weights:
        raise ValueError(f"weights 'fp8': {target_for(cfg).title} checkpoints are dense (use bf16)")
    build = _AbstractParams(cfg, dtype, weights == "fp8", mesh)
    sizes = checkpoint_format(cfg).group_sizes(cfg, mtp)
    params = {}
    groups = build.groups(mtp)
    if draft_cfg is not None:  # the draft declares its own tree (Draft.abstract_params)
        draft = draft_for_config(draft_cfg)
        groups[draft.params_group] = draft.abstract_params(draft_cfg, build)
    for name, tree in groups.items():
        if all(getattr(s, "sharding", None) is not None for s in jax.tree.leaves(tree)):
            params[name] = tree  # placed by its declaration already (a draft model's own tree)
            continue
        stacked = name in sizes
        shardings = group_shardings(mesh, name, tree, stacked=stacked)
        if stacked:
            params[name] = jax.tree.map(lambda s, sh, n=sizes[name]: _stacked(s, n, sh), tree, shardings)
        else:
            params[name] = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings
            )
    return params


# --- abstract decode state ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Pages of the decode state for ``batch`` rows of up to ``max_len`` tokens each.

    A row owns ``width`` pages: its tokens plus the speculative overshoot the engine reserves
    (target rows up to K ahead, MTP rows up to 2K ahead). The engine additionally rounds the width
    up to a power of two; the plan does not, so the cache is exactly what was asked for.
    """

    batch: int
    max_len: int
    page_size: int
    k: int

    @property
    def width(self) -> int:
        return math.ceil((self.max_len + 2 * (self.k + 1)) / self.page_size)

    @property
    def num_pages(self) -> int:
        return self.batch * self.width


def abstract_state(sc: Any, layout: CacheLayout, dtype: Any) -> Any:
    """The :class:`mtp_jax.step.DecodeState` of ``layout`` as ShapeDtypeStructs with the engine's
    shardings (:func:`mtp_jax.sharding.state_shardings`); nothing allocated."""
    from mtp_jax.step import init_state

    shapes = jax.eval_shape(lambda: init_state(sc, layout.batch, layout.num_pages, layout.width, dtype))
    shardings = state_shardings(sc, shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard per leaf)."""
    total = 0
    for s in jax.tree.leaves(tree):
        shape = s.sharding.shard_shape(s.shape) if s.sharding is not None else s.shape
        total += math.prod(shape) * jnp.dtype(s.dtype).itemsize
    return total


def split_param_bytes(params: dict) -> tuple[int, int]:
    """(replicated bytes, expert-sharded bytes) one device holds of abstract ``params``."""
    replicated = sharded = 0
    for s in jax.tree.leaves(params):
        nbytes = shard_bytes(s)
        if any(axis is not None for axis in s.sharding.spec):
            sharded += nbytes
        else:
            replicated += nbytes
    return replicated, sharded


# --- compile and report -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """One compiled function: seconds to lower and to compile, and XLA's per-device memory analysis
    (bytes; ``peak_bytes`` = arguments + outputs - aliased + temporaries + generated code)."""

    name: str
    lower_seconds: float
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int

    @property
    def peak_bytes(self) -> int:
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.generated_code_bytes
        )


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """Per-device memory and compile times of the unified step (and prefill) on a mesh.

    ``param_bytes``/``expert_bytes``: replicated parameters and this device's share of the split
    ones (DeepSeek-V3's routed experts, Llama's tensor-parallel slices);
    ``cache_bytes``: this device's share of the target and MTP latent caches; ``state_bytes``: the
    rest of the decode state. ``estimate_weight_bytes``: the analytic estimate of ``mtp-jax
    inspect`` (:func:`mtp_jax.estimate.per_device_memory`) for comparison.
    """

    model: str
    mesh: dict[str, int]
    platform: str
    weights: str
    dtype: str
    layout: CacheLayout
    param_bytes: int
    expert_bytes: int
    cache_bytes: int
    state_bytes: int
    estimate_weight_bytes: int
    compiled: tuple[CompiledMemory, ...]
    disabled_passes: tuple[str, ...] = ()
    split_label: str = "routed experts"
    draft: str | None = None
    """The draft method planned ("mtp", "eagle3"; None with K = 0)."""

    @property
    def weight_bytes(self) -> int:
        return self.param_bytes + self.expert_bytes

    @property
    def peak_bytes(self) -> int:
        """The largest per-device peak over the compiled functions."""
        return max(c.peak_bytes for c in self.compiled)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["weight_bytes"] = self.weight_bytes
        out["peak_bytes"] = self.peak_bytes
        for entry, c in zip(out["compiled"], self.compiled, strict=True):
            entry["peak_bytes"] = c.peak_bytes
        return out


def _compile(
    name: str, fn: Callable[..., Any], args: tuple, log: TextIO | None, disabled_passes: tuple[str, ...]
) -> CompiledMemory:
    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    say(f"{name}: lowering ...")
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    say(
        f"{name}: lowered in {t1 - t0:.1f}s; compiling (XLA; DeepSeek-V3 takes under a minute on 2 cores) ..."
    )
    options = {"xla_disable_hlo_passes": ",".join(disabled_passes)} if disabled_passes else None
    compiled = lowered.compile(compiler_options=options)
    t2 = time.perf_counter()
    say(f"{name}: compiled in {t2 - t1:.1f}s")
    mem = compiled.memory_analysis()
    if mem is None:
        raise RuntimeError(f"XLA gave no memory analysis for {name} on {jax.default_backend()}")
    sizes = [int(getattr(mem, field)) for field in MEMORY_FIELDS]
    return CompiledMemory(name, t1 - t0, t2 - t1, *sizes)


def check_plan(
    cfg: ModelConfig,
    mesh_axes: Mapping[str, int],
    batch: int,
    max_len: int,
    page_size: int,
    k: int,
    weights: str,
    prefill_len: int,
    draft_cfg: Any = None,
    draft: str | None = None,
) -> dict[str, int]:
    """Validate :func:`plan`'s arguments before anything is compiled (ValueError with the reason);
    returns the mesh axes with missing ones set to 1."""
    axes = _check_mesh(cfg, mesh_axes)
    for name, value in (("batch", batch), ("max_len", max_len), ("page_size", page_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= k <= 16:
        raise ValueError(f"k must be in [0, 16], got {k}")
    if draft is not None:
        if draft not in DRAFTS:
            raise ValueError(f"unknown draft {draft!r}; registered: {', '.join(DRAFTS)}")
        if DRAFTS[draft].config_class is not None and draft_cfg is None:
            raise ValueError(
                f"draft {draft!r} is a separately loaded draft: give its config (--draft-config)"
            )
        if draft_cfg is not None and (kind := draft_for_config(draft_cfg).name) != draft:
            raise ValueError(f"the draft config is a {kind!r} draft, not {draft!r}")
    check_draft = None if draft_cfg is None else draft_for_config(draft_cfg).check_plan
    if check_draft is not None:
        check_draft(draft_cfg, cfg, k)  # the draft's own checks
    own = target_for(cfg).own_draft(cfg)
    if draft is None and draft_cfg is None and k and own is None:
        raise ValueError(
            f"k > 0 needs a draft, but a {target_for(cfg).title} checkpoint of this config has none of its "
            "own (e.g. an MTP layer): use k 0, plan a separately trained draft (--draft-config), or "
            "name a registered one (--draft, e.g. ngram)"
        )
    if weights not in PLAN_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(PLAN_WEIGHTS)}, got {weights!r}")
    if weights == "fp8" and not target_for(cfg).fp8_weights:
        raise ValueError(f"weights 'fp8': {target_for(cfg).title} checkpoints are dense (use bf16)")
    if batch % (axes["data"] * axes["expert"]):
        raise ValueError(
            f"batch {batch} must be a multiple of data x expert = {axes['data'] * axes['expert']}: rows "
            "and their KV pages are split over both (data-parallel attention)"
        )
    if not 0 <= prefill_len <= max_len:
        raise ValueError(f"prefill_len must be in [0, max_len={max_len}], got {prefill_len}")
    return axes


def plan(
    cfg: ModelConfig,
    mesh_axes: Mapping[str, int],
    *,
    batch: int = 8,
    max_len: int = 4096,
    page_size: int = 16,
    k: int = 3,
    weights: str = "fp8",
    dtype: str = "bfloat16",
    prefill_len: int = 0,
    model: str = "",
    log: TextIO | None = None,
    cpu_as_is: bool = False,
    draft_cfg: Any = None,
    draft: str | None = None,
) -> PlanReport:
    """Lower and compile the unified step for ``cfg`` on a mesh of ``mesh_axes`` (data, expert,
    tensor; missing axes 1) from abstract shapes, and measure it per device.

    ``batch`` rows of ``max_len`` tokens (KV cache, see :class:`CacheLayout`), ``k`` drafts per
    step (0: plain decoding, no draft) from the MTP layer, a separately loaded draft of config
    ``draft_cfg`` (EAGLE-3, DFlash, a draft model: its own weights and paged cache), or the
    registered draft named ``draft`` (e.g. "ngram", or a plug-in), weights as in :func:`abstract_params`,
    ``dtype`` for the dense parameters, activations and caches. ``prefill_len`` > 0 also compiles
    prefill of prompts of that many tokens, one per row shard (data x expert rows: admitting one
    request, the engine pads its prefill batch so). The process needs the mesh's devices
    (:func:`request_host_devices`). Progress lines go to ``log`` (e.g. sys.stderr). On the CPU
    backend the passes in :data:`CPU_DISABLED_PASSES` are off unless ``cpu_as_is``.
    """
    from mtp_jax.step import StepConfig, prefill, step

    axes = check_plan(cfg, mesh_axes, batch, max_len, page_size, k, weights, prefill_len, draft_cfg, draft)
    jdtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype]
    mesh = make_mesh(**axes, devices=plan_devices(math.prod(axes.values())))
    layout = CacheLayout(batch, max_len, page_size, k)
    draft_cfg = draft_cfg if k else None
    if not k:
        draft = None
    elif draft is None:
        draft = target_for(cfg).own_draft(cfg) if draft_cfg is None else draft_for_config(draft_cfg).name
    sc = StepConfig(cfg, page_size, k, draft, "argmax", mesh, draft_cfg=draft_cfg)
    own = draft is not None and draft == target_for(cfg).own_draft(cfg)  # its weights in the checkpoint
    params = abstract_params(cfg, mesh, jdtype, weights=weights, mtp=own, draft_cfg=draft_cfg)
    why = None if draft is None else DRAFTS[draft].available(params, cfg)
    if why is not None:
        raise ValueError(why)
    state = abstract_state(sc, layout, jdtype)
    replicated, experts = split_param_bytes(params)
    cache = shard_bytes((state.target_pages, state.draft_state))
    platform = mesh.devices.flat[0].platform
    disabled = CPU_DISABLED_PASSES if platform == "cpu" and not cpu_as_is else ()
    compiled = [_compile("step", step, (params, state, sc), log, disabled)]
    if prefill_len:
        args = (params, state, sc, *_prefill_args(layout, prefill_len, row_shards(mesh)))
        compiled.append(_compile("prefill", prefill, args, log, disabled))
    estimate = per_device_memory(
        cfg, "fp8" if weights == "fp8" else "bf16", axes, 0, include_mtp=own
    )  # the target (and its own draft): a separate draft's weights are not in the analytic estimate
    return PlanReport(
        model=model,
        mesh=axes,
        platform=platform,
        weights=weights,
        dtype=dtype,
        layout=layout,
        param_bytes=replicated,
        expert_bytes=experts,
        cache_bytes=cache,
        state_bytes=shard_bytes(state) - cache,
        estimate_weight_bytes=estimate.weight_bytes,
        compiled=tuple(compiled),
        disabled_passes=disabled,
        split_label="routed experts" if target_for(cfg).split_axis == "expert" else "tensor-split params",
        draft=draft,
    )


def _prefill_args(layout: CacheLayout, length: int, rows: int) -> tuple:
    """Abstract (rows, tokens, lengths, page_table, sampling) for ``rows`` prompts of ``length`` tokens."""
    from mtp_jax.sampling import RowSampling

    def i32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    sampling = jax.eval_shape(lambda: RowSampling.build(rows))
    return i32(rows), i32(rows, length), i32(rows), i32(rows, layout.width), sampling


def format_plan(report: PlanReport, device_memory_gb: float | None = None) -> str:
    """A readable report: setup, per-device memory by kind, XLA's analysis and compile times per
    function, and with ``device_memory_gb`` (10^9 bytes) whether the peak fits and by how much."""
    lay = report.layout
    mesh = " ".join(f"{k}={v}" for k, v in report.mesh.items())
    method = draft_for(report.draft) if report.draft else None
    name = (method.title or method.name) if method else ""
    draft = f"{name} K={lay.k}" if lay.k else "plain (K=0)"
    cache_label = f"KV cache (target + {name})" if lay.k else "KV cache"
    lines = [
        f"Plan: {report.model or 'model'} on mesh {mesh} ({math.prod(report.mesh.values())} "
        f"{report.platform} devices), {report.weights} weights, {report.dtype} activations/cache",
        f"  decode batch {lay.batch} rows x {lay.max_len} tokens, page {lay.page_size} "
        f"({lay.width} pages per row, {lay.num_pages} pages), {draft}",
        "",
        "Per device (from the abstract shardings)",
        f"  {'replicated params':<26}{format_bytes(report.param_bytes):>12}",
        f"  {report.split_label:<26}{format_bytes(report.expert_bytes):>12}",
        f"  {'weights total':<26}{format_bytes(report.weight_bytes):>12}"
        f"  (analytic estimate {format_bytes(report.estimate_weight_bytes)}"
        + (", the target alone)" if method is not None and method.config_class is not None else ")"),
        f"  {cache_label:<26}{format_bytes(report.cache_bytes):>12}",
        f"  {'other decode state':<26}{format_bytes(report.state_bytes):>12}",
    ]
    if report.disabled_passes:
        lines.append(f"  (XLA passes disabled: {', '.join(report.disabled_passes)}; see mtp_jax.plan)")
    for c in report.compiled:
        lines += [
            "",
            f"{c.name}: lowered in {c.lower_seconds:.1f}s, compiled in {c.compile_seconds:.1f}s; "
            "XLA memory analysis per device",
            f"  {'arguments':<26}{format_bytes(c.argument_bytes):>12}",
            f"  {'outputs':<26}{format_bytes(c.output_bytes):>12}",
            f"  {'aliased (donated state)':<26}{format_bytes(c.alias_bytes):>12}",
            f"  {'temporaries':<26}{format_bytes(c.temp_bytes):>12}",
            f"  {'generated code':<26}{format_bytes(c.generated_code_bytes):>12}",
            f"  {'peak (args+out-alias+temp)':<26}{format_bytes(c.peak_bytes):>12}",
        ]
    if device_memory_gb is not None:
        capacity = int(device_memory_gb * GB)
        headroom = capacity - report.peak_bytes
        verdict = "fits" if headroom >= 0 else "does NOT fit"
        lines += [
            "",
            f"Device memory {device_memory_gb:g} GB: {verdict} (peak {format_bytes(report.peak_bytes)}, "
            f"headroom {format_bytes(headroom) if headroom >= 0 else '-' + format_bytes(-headroom)})",
        ]
    return "\n".join(lines)
