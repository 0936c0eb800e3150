"""What a request asks for, and the one place where it is checked.

:class:`SamplingParams` holds one request's settings: how many tokens, how to sample them, when to
stop, its grammar, and how far it lets speculation go. :class:`SpeculativeConfig` holds how a
``generate`` call or an :class:`~mtp_jax.serving.Engine` speculates: the draft, K, how drafts are
drawn (vLLM's two concepts, with this project's names). ``Model.generate``, ``Engine.submit`` and
the server all pass through the same two functions, so the same mistake gets the same message
everywhere:

- :func:`step_config`: speculation settings -> the step's static configuration
  (:class:`~mtp_jax.step.StepConfig`), asking the draft (:class:`~mtp_jax.drafts.Draft`'s
  ``configure`` and ``default_k``) for what only the draft knows;
- :func:`check_request`: one prompt and its :class:`SamplingParams` -> a :class:`CheckedRequest`
  (token ids in range, lengths within the context, every value in its range).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mtp_jax.drafts import DRAFTS
from mtp_jax.errors import InvalidRequestError
from mtp_jax.sampling import MAX_DRAFTS, RowSampling, check_column, check_logprobs, check_value, per_row
from mtp_jax.schedule import SCHEDULES
from mtp_jax.step import DRAFT_SAMPLING, StepConfig, with_ring
from mtp_jax.text import check_stops
from mtp_jax.tree import DynamicTree, TokenTree
from pallas_kernels.paged import QUERY_CHUNK

# the per-row numeric settings and their types (checked by mtp_jax.sampling.CHECKS)
_NUMBERS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "seed": int,
    "num_speculative_tokens": int,
    "relaxed_topk": int,
    "relaxed_delta": float,
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's settings (vLLM's ``SamplingParams``, with this project's names).

    ``max_new_tokens``: the most tokens generated (fewer at EOS, a stop or the grammar's end).
    ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off), ``min_p`` (0: off), applied
    in that order, and ``seed`` (a request's tokens depend on its seed, never on its neighbours).
    ``stop``: strings that end the request (cut from its text); ``stop_token_ids``: ids that end it
    (kept); ``ignore_eos``: run past EOS. ``grammar``: {"json_schema": schema}, {"regex": pattern},
    {"lark": grammar} or an OpenAI ``response_format`` the output must follow.
    ``num_speculative_tokens``: the most drafts a step verifies for this request (0: plain
    decoding; None: the K of the call or engine). ``relaxed_topk`` / ``relaxed_delta``: relaxed
    acceptance inside a thinking phase (lossy by design; see :meth:`mtp_jax.Model.generate`).
    ``lora``: the name of a loaded LoRA adapter the request decodes with (None: the base model;
    :meth:`mtp_jax.Model.load_lora`). ``logprobs``: return each new token's log-probability and
    the ``logprobs`` most likely tokens' at its position (0 to MAX_LOGPROBS; None: none);
    ``prompt_logprobs``: the same for every prompt token after the first. Both are taken from
    the target's raw distribution (the logits' log-softmax, before temperature, top-k/p, min-p
    or a grammar: vLLM's default), which speculation does not change. ``cache_salt``: an
    engine's prefix caching shares cached prompt prefixes only among requests with the same salt
    (None is a salt too), so one tenant cannot learn from another's timing what it asked (vLLM's
    ``cache_salt``); offline ``generate`` has no prefix cache and ignores it.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    grammar: dict | None = None
    num_speculative_tokens: int | None = None
    relaxed_topk: int = 0
    relaxed_delta: float = 0.0
    lora: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None

    @classmethod
    def per_prompt(cls, n: int, **values: Any) -> list[SamplingParams]:
        """One instance per prompt from the keyword form: each numeric setting a scalar or one value
        per prompt (its message names the row), ``grammar`` one spec or one per prompt, the others
        one value for all."""
        unknown = sorted(set(values) - set(SAMPLING_FIELDS))
        if unknown:
            raise TypeError(
                f"unknown setting(s) {', '.join(unknown)}; the request settings are {SAMPLING_FIELDS}"
            )
        columns: dict[str, list] = {}
        for name, value in values.items():
            if name in _NUMBERS and value is not None:
                column, given = per_row(name, value, n, _NUMBERS[name])
                check_column(name, column, given)
                columns[name] = column
            elif name in ("grammar", "lora", *LOGPROB_FIELDS) and isinstance(value, (list, tuple)):
                if len(value) != n:
                    raise InvalidRequestError(f"{name} has {len(value)} values for {n} prompts")
                columns[name] = list(value)
            else:
                columns[name] = [value] * n
        return [cls(**{name: column[i] for name, column in columns.items()}) for i in range(n)]


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How a ``generate`` call or an engine speculates (vLLM's ``SpeculativeConfig``, our names).

    ``draft``: a draft method the model has (``Model.drafts``, or a weightless one such as
    "ngram"; None: plain decoding). ``num_speculative_tokens``: K, the most drafts a step verifies
    (None: the draft's default). ``draft_sampling``: "argmax" (propose the draft's argmax) or
    "sampled" (draw drafts from the draft's distribution, accept with min(1, p/q)); exact either
    way. ``draft_options``: settings of the draft's own as one mapping, which the draft checks
    (its ``options``; DFlash: ``{"block_size": n}``, a smaller block than the one it was trained
    on); ``draft_block_size`` is the keyword form of DFlash's.
    ``auto_k`` (``generate`` only): a table written by ``mtp-jax bench --auto-k-table`` or a
    {batch size: K} mapping that caps K by the batch size. ``think_tokens``: the (start, end) ids
    of a thinking phase, for relaxed acceptance (default: the tokenizer's <think> and </think>).
    ``speculative_tree``: verify a token tree of drafts instead of a chain, {"depth": d, "topk": k,
    "nodes": n} (:meth:`mtp_jax.tree.TokenTree.build`: every node's k likeliest continuations up to
    depth d, the n drafts likeliest to be accepted; SGLang's ``speculative_num_steps`` /
    ``speculative_eagle_topk`` / ``speculative_num_draft_tokens`` - 1), for a chained draft (mtp,
    eagle3, draft_model). K is then the tree's nodes; a request's ``num_speculative_tokens`` caps
    the depth it accepts. With ``"dynamic": True`` the tree's shape is each row's own, chosen
    every step (:class:`mtp_jax.tree.DynamicTree`, EAGLE-2: the n candidates of highest cumulative
    draft probability, expanding the k likeliest per level; draft_sampling "argmax").
    ``schedule``: "fixed" (verify every proposed draft, up to each request's cap) or "confidence"
    (each step verifies the width :func:`mtp_jax.schedule.choose_width` picks from the draft's
    confidences and measured speeds; a draft with a confidence head: DSpark). ``sps_table``: those
    speeds (:class:`mtp_jax.schedule.SpsTable`, a file ``mtp-jax bench --sps-table`` wrote, or
    {batch: [steps/s at widths 1..K+1]}); None: measured for the call's batch before it starts.
    """

    draft: str | None = None
    num_speculative_tokens: int | None = None
    draft_sampling: str = "argmax"
    draft_block_size: int | None = None
    draft_options: Mapping[str, Any] | None = None
    auto_k: str | os.PathLike[str] | Mapping | Any | None = None
    think_tokens: tuple[int, int] | None = None
    speculative_tree: Mapping | TokenTree | DynamicTree | None = None
    schedule: str = "fixed"
    sps_table: Any = None


SPECULATIVE_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))


def split_settings(
    n: int,
    sampling: SamplingParams | Sequence[SamplingParams] | None,
    speculative: SpeculativeConfig | None,
    settings: dict[str, Any],
) -> tuple[list[SamplingParams], SpeculativeConfig]:
    """(one SamplingParams per prompt, the SpeculativeConfig) of ``n`` prompts, from the objects
    or from keyword ``settings`` (the fields of both; ``num_speculative_tokens`` given per prompt
    caps each request, and the call's K is their largest: 0 for all means no draft runs)."""
    spec_kw = {k: settings.pop(k) for k in list(settings) if k in SPECULATIVE_FIELDS}
    k = spec_kw.get("num_speculative_tokens")
    if isinstance(k, (list, tuple)) or (hasattr(k, "ndim") and k.ndim > 0):
        settings["num_speculative_tokens"] = spec_kw.pop("num_speculative_tokens")
    speculative = speculative_config(speculative, **spec_kw)
    if sampling is None:
        requests = SamplingParams.per_prompt(n, **settings)
    else:
        if settings:
            raise TypeError(f"pass {sorted(settings)} inside sampling=SamplingParams(...), not beside it")
        requests = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        if len(requests) != n:
            raise InvalidRequestError(f"sampling has {len(requests)} SamplingParams for {n} prompts")
        for r in requests:
            if not isinstance(r, SamplingParams):
                raise InvalidRequestError(
                    f"sampling must hold mtp_jax.SamplingParams, got {type(r).__name__}"
                )
    caps = [r.num_speculative_tokens for r in requests]
    if speculative.num_speculative_tokens is None and caps and None not in caps:
        for i, cap in enumerate(caps):  # the call's K comes from them: check them first
            (caps[i],), _ = per_row("num_speculative_tokens", cap, 1, int)
            check_value("num_speculative_tokens", caps[i], f" (row {i})" if n > 1 else "")
        k = max(caps)
        tree = speculative.speculative_tree
        speculative = dataclasses.replace(
            speculative,
            num_speculative_tokens=k if k and tree is None else None,  # a tree's caps are depths
            draft=speculative.draft if k else None,
            speculative_tree=tree if k else None,
        )
    return requests, speculative


def speculative_config(speculative: SpeculativeConfig | None, **fields: Any) -> SpeculativeConfig:
    """``speculative``, or one made of its ``fields`` given as keywords (not both)."""
    if speculative is None:
        return SpeculativeConfig(**fields)
    if not isinstance(speculative, SpeculativeConfig):
        raise InvalidRequestError(
            f"speculative must be a mtp_jax.SpeculativeConfig, got {type(speculative).__name__}"
        )
    if fields:
        raise TypeError(f"pass {sorted(fields)} inside speculative=SpeculativeConfig(...), not beside it")
    return speculative


# keyword forms of draft options: SpeculativeConfig field -> the option it sets
OPTION_KEYWORDS = {"draft_block_size": "block_size"}


def draft_options(speculative: SpeculativeConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """(the draft options ``speculative`` asks for, with their keyword forms folded in; how each was
    written, for messages)."""
    given = speculative.draft_options
    if given is not None and not isinstance(given, Mapping):
        raise InvalidRequestError(f"draft_options must be a mapping, got {type(given).__name__}")
    options = dict(given or {})
    forms = {name: f"draft_options[{name!r}]={value!r}" for name, value in options.items()}
    for field, name in OPTION_KEYWORDS.items():
        value = getattr(speculative, field)
        if value is None:
            continue
        if name in options and options[name] != value:
            raise InvalidRequestError(f"{field}={value!r} disagrees with draft_options {dict(given)}")
        options[name], forms[name] = value, f"{field}={value!r}"
    return options, forms


def step_config(model, speculative: SpeculativeConfig, *, relaxed: bool = False) -> StepConfig:
    """The step configuration that ``speculative`` asks of ``model`` (a loaded
    :class:`~mtp_jax.Model`): the draft checked against what the model has, K resolved (the draft's
    ``configure`` hook, else its ``default_k``) and checked, and with ``relaxed`` (some request asks
    for relaxed acceptance) or explicit ``think_tokens`` the thinking phase's markers; with the
    model's ``window_cache="ring"`` its sliding-window layers' rings sized for it."""
    sc = _step_config(model, speculative, relaxed)
    return with_ring(sc) if getattr(model, "window_cache", "pages") == "ring" else sc


def _step_config(model, speculative: SpeculativeConfig, relaxed: bool) -> StepConfig:
    draft, k = speculative.draft, speculative.num_speculative_tokens
    method = DRAFTS.get(draft) if draft is not None else None
    options, forms = draft_options(speculative)
    for name in options:
        if method is None or name not in method.options:
            takers = [d.name for d in DRAFTS.values() if name in d.options]
            owners = (
                ", ".join(takers[:-1]) + (" or " if len(takers) > 1 else "") + (takers[-1] if takers else "")
            )
            raise InvalidRequestError(
                f"{forms[name]} is a setting of draft={owners or 'another draft'}; the draft is {draft!r}"
            )
    tree = token_tree(speculative.speculative_tree)
    if tree is not None:
        if method is None or not method.trees:
            takers = ", ".join(name for name, d in DRAFTS.items() if d.trees)
            raise InvalidRequestError(
                f"speculative_tree needs a draft that proposes token trees ({takers}), got draft={draft!r}"
            )
        if k is not None and k != tree.size - 1:
            raise InvalidRequestError(
                f"a token tree verifies its {tree.size - 1} nodes per step: num_speculative_tokens={k} "
                "cannot go with speculative_tree (a request's own num_speculative_tokens caps its depth)"
            )
        if speculative.auto_k is not None:
            raise InvalidRequestError("auto_k chooses a chain's K; it does not go with speculative_tree")
        if tree.dynamic and speculative.draft_sampling != "argmax":
            raise InvalidRequestError(
                "a dynamic speculative_tree verifies the draft's likeliest tokens (exact for sampled rows "
                f"too): it needs draft_sampling='argmax', got {speculative.draft_sampling!r}"
            )
        if relaxed or speculative.think_tokens is not None:
            raise InvalidRequestError(
                "relaxed acceptance (think_tokens) is not available with token trees yet"
            )
        k = tree.size - 1
    if draft is None:
        if k not in (None, 0):
            raise InvalidRequestError(
                f"num_speculative_tokens={k} needs a draft (draft=one of {list(DRAFTS)})"
            )
        if relaxed or speculative.think_tokens is not None:
            raise InvalidRequestError(
                "relaxed_topk (with think_tokens) relaxes the acceptance of drafts: it needs a draft"
            )
        if speculative.auto_k is not None:
            raise InvalidRequestError("auto_k chooses how many drafts to verify: it needs a draft")
        return StepConfig(model.config, model.page_size, mesh=model.mesh, draft_cfg=model.draft_config)
    if method is None:
        raise InvalidRequestError(f"unknown draft {draft!r}; available: {', '.join(DRAFTS)}")
    why = method.available(model.params, model.config)
    if why is not None:
        raise InvalidRequestError(f"{why}; {model.path or 'this model'} cannot draft with {draft!r}")
    draft_cfg = model.draft_config
    if method.configure is not None:
        draft_cfg, k = method.configure(draft_cfg, k, options)
    k = method.default_k if k is None else k
    if tree is None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFTS):
        raise InvalidRequestError(
            f"num_speculative_tokens must be an integer in [1, {MAX_DRAFTS}], got {k!r}"
        )
    if speculative.draft_sampling not in DRAFT_SAMPLING:
        raise InvalidRequestError(
            f"draft_sampling must be one of {DRAFT_SAMPLING}, got {speculative.draft_sampling!r}"
        )
    think = None
    if relaxed or speculative.think_tokens is not None:
        think = thinking_markers(model, speculative.think_tokens)
    how = speculative.draft_sampling
    check_schedule(speculative, method, draft_cfg, tree)
    return StepConfig(
        model.config, model.page_size, k, draft, how, model.mesh, draft_cfg, think_tokens=think, tree=tree
    )


def check_schedule(speculative: SpeculativeConfig, method: Any, draft_cfg: Any, tree: Any) -> None:
    """InvalidRequestError unless ``speculative.schedule`` is one the draft can follow."""
    schedule = speculative.schedule
    if schedule not in SCHEDULES:
        raise InvalidRequestError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "fixed":
        if speculative.sps_table is not None:
            raise InvalidRequestError("sps_table is what schedule='confidence' weighs; this one is 'fixed'")
        return
    if method is None or method.confidence is None or not method.confidence(draft_cfg):
        takers = ", ".join(d.title or name for name, d in DRAFTS.items() if d.confidence)
        raise InvalidRequestError(
            f"schedule='confidence' needs a draft that estimates its acceptance ({takers}, with a "
            f"confidence head); draft={speculative.draft!r} does not"
        )
    if tree is not None:
        raise InvalidRequestError("schedule='confidence' verifies a chain, not a speculative_tree")


def token_tree(spec: Mapping | TokenTree | DynamicTree | None) -> TokenTree | DynamicTree | None:
    """The tree of a ``speculative_tree`` setting ({"depth", "topk", "nodes", "dynamic"}): a
    static :class:`~mtp_jax.tree.TokenTree`, or with ``"dynamic": True`` a
    :class:`~mtp_jax.tree.DynamicTree` (EAGLE-2: each row's shape chosen by the draft every step,
    under the same node budget); or None."""
    if spec is None or isinstance(spec, (TokenTree, DynamicTree)):
        return spec
    fields = ("depth", "topk", "nodes", "dynamic")
    if not isinstance(spec, Mapping) or set(spec) - set(fields) or not {"depth", "topk"} <= set(spec):
        raise InvalidRequestError(
            f"speculative_tree must be {{'depth': d, 'topk': k, 'nodes': n, 'dynamic': False}} (nodes "
            f"optional: the whole static tree; dynamic optional), got {spec!r}"
        )
    depth, topk = spec["depth"], spec["topk"]
    nodes, dynamic = spec.get("nodes"), spec.get("dynamic", False)
    if not isinstance(dynamic, bool):
        raise InvalidRequestError(f"speculative_tree's dynamic must be true or false, got {dynamic!r}")
    if nodes is None and all(isinstance(x, int) and not isinstance(x, bool) for x in (depth, topk)):
        nodes = sum(topk**d for d in range(1, depth + 1))
        if dynamic and depth >= 1 and topk >= 1:  # as many as the dynamic tree has candidates
            nodes = min(nodes, DynamicTree.candidates(depth, topk))
    tree = DynamicTree(depth, topk, nodes) if dynamic else TokenTree.build(depth, topk, nodes)
    if tree.size > QUERY_CHUNK:
        raise InvalidRequestError(
            f"a token tree has at most {QUERY_CHUNK - 1} draft nodes, got {tree.size - 1}"
        )
    return tree


def thinking_markers(model, given: tuple[int, int] | None) -> tuple[int, int]:
    """(start, end) ids of a thinking phase: ``given``, else the tokenizer's <think>/</think>."""
    if given is not None:
        if not isinstance(given, (tuple, list)) or len(given) != 2:
            raise InvalidRequestError(f"think_tokens must be (start id, end id), got {given!r}")
        ids = [model.check_tokens([t], "think_tokens")[0] for t in given]
        if ids[0] == ids[1]:
            raise InvalidRequestError(f"think_tokens must be two different ids, got {given!r}")
        return ids[0], ids[1]
    if model.tokenizer_path is not None:
        ids = [model.text.tokenizer.token_to_id(t) for t in ("<think>", "</think>")]
        if None not in ids:
            return ids[0], ids[1]
    raise InvalidRequestError(
        "relaxed acceptance needs the thinking phase's markers: the tokenizer has no <think> and "
        "</think> tokens; pass think_tokens=(start id, end id)"
    )


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A request that passed :func:`check_request`: its prompt's token ids, its settings with
    ``stop`` a tuple, ``stop_token_ids`` a tuple of ints and ``num_speculative_tokens`` an int, and
    whether its text is followed (a text prompt, stop strings, or asked for)."""

    prompt: list[int]
    params: SamplingParams
    text: bool
    lora_slot: int = 0
    """The slot of the request's LoRA adapter (0: none), as the model's table had it when checked."""

    def to_json(self) -> dict:
        """Plain JSON values (what the other processes of a multi-process engine are sent)."""
        params = dataclasses.asdict(self.params)
        params["stop"], params["stop_token_ids"] = list(self.params.stop), list(self.params.stop_token_ids)
        return {"prompt": list(self.prompt), "params": params, "text": self.text, "lora_slot": self.lora_slot}

    @classmethod
    def from_json(cls, spec: dict) -> CheckedRequest:
        """A request :meth:`to_json` wrote (checked where it was written)."""
        p = dict(spec["params"])
        p["stop"], p["stop_token_ids"] = tuple(p["stop"]), tuple(p["stop_token_ids"])
        return cls(
            list(spec["prompt"]), SamplingParams(**p), bool(spec["text"]), int(spec.get("lora_slot", 0))
        )


def check_request(
    model,
    prompt: Sequence[int] | str,
    params: SamplingParams,
    sc: StepConfig,
    *,
    context: int,
    context_name: str,
    where: str = "the prompt",
    text: bool = False,
) -> CheckedRequest:
    """Check one request for a step configured as ``sc``: the prompt (token ids, or text encoded
    with the model's tokenizer) and every setting of ``params``. ``context`` is how many tokens a
    request may reach (prompt and new tokens), ``context_name`` how messages name that limit,
    ``where`` how they name the prompt; ``text`` asks for the request's text. Raises
    :class:`~mtp_jax.InvalidRequestError` naming the first problem."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling must be a mtp_jax.SamplingParams, got {type(params).__name__}")
    stops = check_stops(params.stop)
    ids = model.check_tokens(model.text.encode(prompt) if isinstance(prompt, str) else prompt, where)
    n = params.max_new_tokens
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise InvalidRequestError(f"max_new_tokens must be an integer, got {n!r}")
    n = int(n)
    if n < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {n}")
    if len(ids) + n > context:
        raise InvalidRequestError(
            f"{where} has {len(ids)} tokens; with max_new_tokens={n} it would reach {len(ids) + n}, "
            f"beyond {context_name}"
        )
    values = {}
    for name, kind in _NUMBERS.items():
        value = getattr(params, name)
        if name == "num_speculative_tokens" and value is None:
            value = sc.k if sc.tree is None else sc.tree.max_depth
        (value,), _ = per_row(name, value, 1, kind)
        check_value(name, value)
        values[name] = value
    most = sc.k if sc.tree is None else sc.tree.max_depth
    if values["num_speculative_tokens"] > most:
        kind = "the engine's K" if sc.tree is None else "the token tree's depth"
        raise InvalidRequestError(
            f"num_speculative_tokens must be an integer in [0, {most}] ({kind}), "
            f"got {params.num_speculative_tokens!r}"
        )
    if values["relaxed_topk"] and sc.think_tokens is None:  # generate() sets them for such requests
        raise InvalidRequestError("relaxed_topk needs an engine created with think_tokens and a draft")
    stop_ids = ()
    if params.stop_token_ids:
        stop_ids = tuple(model.check_tokens(list(params.stop_token_ids), "stop_token_ids"))
    if not isinstance(params.ignore_eos, bool):
        raise InvalidRequestError(f"ignore_eos must be a boolean, got {params.ignore_eos!r}")
    tops = {name: check_logprobs(name, getattr(params, name), optional=True) for name in LOGPROB_FIELDS}
    if params.cache_salt is not None and (not isinstance(params.cache_salt, str) or not params.cache_salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {params.cache_salt!r}")
    slot = 0
    if params.lora is not None:
        if not isinstance(params.lora, str):
            raise InvalidRequestError(f"lora must be an adapter's name, got {params.lora!r}")
        table = getattr(model, "lora", None)
        if table is None:
            raise InvalidRequestError(
                f"LoRA adapter {params.lora!r} asked for, but the model has none "
                "(load it with lora_adapters=...)"
            )
        slot = table.slot_of(params.lora)
    checked = dataclasses.replace(
        params, **values, **tops, max_new_tokens=n, stop=tuple(stops), stop_token_ids=stop_ids
    )
    return CheckedRequest(ids, checked, bool(text or stops or isinstance(prompt, str)), slot)


def row_sampling(requests: Sequence[CheckedRequest]) -> RowSampling:
    """The step's per-row sampling values of checked requests, one row each."""
    column = {name: [getattr(r.params, name) for r in requests] for name in _NUMBERS}
    return RowSampling.build(
        len(requests),
        column["temperature"],
        column["top_k"],
        column["top_p"],
        column["min_p"],
        column["seed"],
        num_speculative_tokens=column["num_speculative_tokens"],
        relaxed_topk=column["relaxed_topk"],
        relaxed_delta=column["relaxed_delta"],
        lora_slot=[r.lora_slot for r in requests],
    )
