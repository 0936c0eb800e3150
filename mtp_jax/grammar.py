"""Grammar-constrained decoding: per-request JSON schemas, regular expressions and Lark grammars.

A request's grammar is compiled by llguidance (optional extra: ``pip install 'mtp-jax[grammar]'``)
against the model's own ``tokenizer.json``. Before every step the host fills, for each constrained
row, the token bitmask (int32, ceil(V/32) words, bit v of word v // 32 set when token v is allowed)
at each of the K+1 positions the step verifies: after the committed text, then after each of the
row's drafts in turn (llguidance computes the masks along the drafts and rolls back). Inside the
step the target's logits are masked before acceptance (:func:`mask_logits`), so acceptance is exact
with respect to the masked distribution and a draft the grammar forbids is simply rejected. After
the step the matchers consume the emitted tokens. Rows without a grammar get all-ones masks, which
leave their logits, and so their tokens, untouched bit for bit.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from mtp_jax.errors import InvalidRequestError

# How the masks reach the step: "host" (the engine reads each step's drafts and computes the next
# step's masks before dispatching it) or "callback" (the step asks the host for them through an
# ordered io_callback, so the engine keeps dispatching a step ahead). BENCHMARKS.md measures both.
DELIVERIES = ("host", "callback")

KINDS = ("json_schema", "regex", "lark")
COMPILED_GRAMMARS = 256
"""Distinct grammars whose validated matcher a :class:`Constraints` keeps (least recently used
dropped first)."""


def words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def mask_logits(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Logits [..., V] with the tokens the bitmask [..., ceil(V/32)] forbids set to -inf."""
    v = logits.shape[-1]
    ids = jnp.arange(v, dtype=jnp.int32)
    word = jnp.take(bitmask, ids // 32, axis=-1)
    allowed = jnp.bitwise_and(jnp.right_shift(word.view(jnp.uint32), (ids % 32).astype(jnp.uint32)), 1) == 1
    return jnp.where(allowed, logits, -jnp.inf)


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError as e:
        raise InvalidRequestError(
            "grammar-constrained decoding needs llguidance: pip install 'mtp-jax[grammar]'"
        ) from e
    return llguidance


def grammar_text(spec: object) -> str:
    """llguidance's grammar for one request's spec: {"json_schema": schema (dict or JSON text)},
    {"regex": pattern}, {"lark": grammar}, or an OpenAI-style response_format
    ({"type": "json_schema", "json_schema": {"schema": ...}} / {"type": "json_object"})."""
    llg = _llguidance()
    if not isinstance(spec, Mapping):
        raise InvalidRequestError(
            f"a grammar is a dict with one of {KINDS} (or a response_format), got {type(spec).__name__}"
        )
    if spec.get("type") == "json_object":
        spec = {"json_schema": {"type": "object"}}
    elif spec.get("type") == "json_schema":
        inner = spec.get("json_schema")
        if not isinstance(inner, Mapping) or "schema" not in inner:
            raise InvalidRequestError('response_format {"type": "json_schema"} needs json_schema.schema')
        spec = {"json_schema": inner["schema"]}
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1 or len(spec) != 1:
        raise InvalidRequestError(f"a grammar names exactly one of {KINDS}, got keys {sorted(spec)}")
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"json_schema is not valid JSON: {e}") from e
        if not isinstance(value, (Mapping, bool)):
            raise InvalidRequestError(f"json_schema must be a JSON object, got {type(value).__name__}")
        try:
            schema = dict(value) if isinstance(value, Mapping) else value
            # compact JSON by default ("x-guidance" in the schema overrides it): flexible
            # whitespace lets a model pad forever between tokens
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise InvalidRequestError(f"json_schema: {e}") from e
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{kind} must be a non-empty string, got {value!r}")
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    return llg.LLMatcher.grammar_from_lark(value)


class Constraints:
    """The grammars and matchers of a scheduler's requests (by request id), on the model's
    tokenizer. ``specs`` adds requests 0, 1, ... (None: unconstrained); :meth:`add` adds more."""

    def __init__(
        self,
        tokenizer_path: str | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        specs: Sequence[object] = (),
    ) -> None:
        llg = _llguidance()
        if tokenizer_path is None or not os.path.isfile(tokenizer_path):
            raise InvalidRequestError("grammar-constrained decoding needs the model's tokenizer.json")
        if not eos_token_ids:
            raise InvalidRequestError("grammar-constrained decoding needs the model's EOS token id")
        self.tokenizer = llg.LLTokenizer(tokenizer_path, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.words = words(vocab_size)
        self.grammars: dict[int, str] = {}
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        """Grammar text -> an unused matcher of it (validated), most recently used last: requests that
        share a grammar (a server's JSON schema, a batch's one regex) validate and build it once."""
        for i, spec in enumerate(specs):
            self.add(i, spec, f"prompt {i}")
        self.matchers: dict[int, Any] = {}
        # the in-step callback's own matchers (request -> [matcher, seq_len seen, drafts seen]),
        # apart from the engine's, which advance when the engine reads a step: the two never share
        # state across threads
        self.ahead: dict[int, list] = {}
        self.fresh: dict[int, Any] = {}
        self.error: str | None = None
        self.key = next(_KEYS)
        """What the in-step callback finds these constraints by (:func:`in_step_masks`)."""
        _BY_KEY[self.key] = self
        self._executor = llg.LLExecutor()
        self._fill_along = llg.numpy.fill_next_token_bitmask_par_with_draft_tokens
        self._fill = llg.numpy.fill_next_token_bitmask_par
        self.seconds = 0.0  # host time in consume() and masks()

    def add(self, req: int, spec: object, label: str = "the request") -> None:
        """Compile and check request ``req``'s grammar (None: unconstrained); errors name ``label``."""
        if spec is None:
            return
        llg = _llguidance()
        try:
            text = grammar_text(spec)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"grammar of {label}: {e}") from None
        if text in self._compiled:
            self._compiled.move_to_end(text)
        else:
            error = llg.LLMatcher.validate_grammar(text, self.tokenizer)
            if error and not error.startswith("WARNING"):
                raise InvalidRequestError(f"grammar of {label} is invalid: {' '.join(error.split())}")
            self._remember(text, None)  # its matcher is built by the first request that starts
        self.grammars[req] = text

    def _remember(self, text: str, matcher: Any) -> None:
        self._compiled[text] = matcher
        while len(self._compiled) > COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)

    def constrained(self, req: int) -> bool:
        return req in self.grammars

    def start(self, req: int, prompt: Sequence[int]) -> None:
        """A fresh matcher for request ``req`` (the grammar constrains the new tokens only)."""
        text = self.grammars[req]
        template = self._compiled.get(text)
        if template is None:  # first start of this grammar, or evicted since its request was added
            template = _llguidance().LLMatcher(self.tokenizer, text, log_level=0)
            self._remember(text, template)
        self.matchers[req] = template.deep_copy()
        self.fresh[req] = template.deep_copy()

    def consume(self, req: int, token: int) -> bool:
        """Advance request ``req`` over an emitted token; True once its grammar has ended."""
        t0 = time.perf_counter()
        m = self.matchers[req]
        if not m.consume_token(token):
            raise RuntimeError(f"the grammar of prompt {req} refused token {token}: {m.get_error()}")
        stopped = m.is_stopped()
        self.seconds += time.perf_counter() - t0
        return stopped

    def finish(self, req: int) -> None:
        self.grammars.pop(req, None)
        self.matchers.pop(req, None)
        self.fresh.pop(req, None)
        self.ahead.pop(req, None)

    def masks(self, rows: Sequence[tuple[int, int, Sequence[int]]], shape: tuple[int, ...]) -> np.ndarray:
        """Bitmasks [*shape, words] (all ones where unconstrained) for rows (request, flat index of
        the first position, drafts): position j after the committed text and drafts[:j]."""
        t0 = time.perf_counter()
        out = np.full((int(np.prod(shape)), self.words), -1, np.int32)
        self._fill_rows([(self.matchers[req], index, drafts) for req, index, drafts in rows], out)
        self.seconds += time.perf_counter() - t0
        return out.reshape(*shape, self.words)

    def tree_masks(
        self, rows: Sequence[tuple[int, int, Sequence[int]]], tree, shape: tuple[int, ...]
    ) -> np.ndarray:
        """Bitmasks [*shape, words] for rows (request, flat index of a token tree's root, the
        tree's draft tokens [N-1]) of a :class:`mtp_jax.tree.TokenTree` (or a list of them, each
        row's own): node n's row after the committed text and the tokens of n's path below the root
        (each leaf's path at once, over the rows of one shape)."""
        if isinstance(tree, list):  # rows of the same shape together
            out = np.full((int(np.prod(shape)), self.words), -1, np.int32)
            groups: dict[Any, list] = {}
            for row, own in zip(rows, tree, strict=True):
                groups.setdefault(own, []).append(row)
            for own, group in groups.items():
                masks = self.tree_masks(group, own, shape).reshape(-1, self.words)
                for _, index, _ in group:
                    out[index : index + own.size] = masks[index : index + own.size]
            return out.reshape(*shape, self.words)
        t0 = time.perf_counter()
        out = np.full((int(np.prod(shape)), self.words), -1, np.int32)
        nodes = [np.concatenate([[0], np.asarray(drafts)]) for _, _, drafts in rows]  # node 0: committed
        for path in (np.asarray(p) for p in tree.paths()):
            # one path of every row at once (each row's matcher once per call: the fill runs rows in
            # parallel and rolls each matcher back after its drafts)
            along = np.full((len(rows) * len(path), self.words), -1, np.int32)
            fill = [
                (self.matchers[req], i * len(path), tokens[path[1:]])
                for i, ((req, _, _), tokens) in enumerate(zip(rows, nodes, strict=True))
            ]
            self._fill_rows(fill, along)
            for i, (_, index, _) in enumerate(rows):
                out[index + path] = along[i * len(path) : (i + 1) * len(path)]
        self.seconds += time.perf_counter() - t0
        return out.reshape(*shape, self.words)

    def step_masks(self, running: Sequence[Any], drafts, k: int, tree=None) -> np.ndarray | None:
        """A step's masks [slots, k+1, words] for the requests ``running`` in each slot (None where
        none; the others' ``id``s), from the ``drafts`` [slots, >= k] the last step left (with a
        token tree, every node's along its path; ``tree`` a list: each slot's own tree, a dynamic
        tree's rows, None for slots without a constrained request); None when no running request
        is constrained."""
        rows = [(b, req.id) for b, req in enumerate(running) if req is not None and self.constrained(req.id)]
        if not rows:
            return None
        drafts = np.asarray(drafts[:, :k])
        found = [(req, b * (k + 1), drafts[b]) for b, req in rows]
        shape = (len(running), k + 1)
        if not k or tree is None:
            return self.masks(found, shape)
        if isinstance(tree, list):
            tree = [tree[b] for b, _ in rows]
        return self.tree_masks(found, tree, shape)

    def _fill_rows(self, rows: Sequence[tuple[Any, int, Sequence[int]]], out: np.ndarray) -> None:
        along, alone = [], []
        for m, index, drafts in rows:
            # the drafts after one the grammar forbids are never reached: masks only up to it
            valid = m.validate_tokens([int(d) for d in drafts])
            if valid:
                along.append((m, index, [int(d) for d in drafts[:valid]]))
            else:
                alone.append((m, index))
        if along:
            self._fill_along(self._executor, along, out)
        if alone:
            self._fill(self._executor, alone, out)

    def callback_masks(
        self, rows: np.ndarray, seq_len: np.ndarray, next_token: np.ndarray, drafts: np.ndarray
    ) -> np.ndarray:
        """The in-step callback's masks [B, k+1, words] at the start of a step. Each constrained
        row first catches up on what the previous step emitted, read off the state: the number
        of tokens is the growth of its committed length, the tokens are the drafts it verified
        (seen by the previous call) followed by its next token."""
        t0 = time.perf_counter()
        b, k = drafts.shape
        out = np.full((b * (k + 1), self.words), -1, np.int32)
        fill = []
        for i, req in enumerate(rows.tolist()):
            if req < 0:
                continue
            entry = self.ahead.get(req)
            if entry is None:
                fresh = self.fresh.pop(req, None)
                if fresh is None or req not in self.grammars:
                    continue  # finished while this step was in flight
                entry = self.ahead[req] = [fresh, None, ()]
            m, seen, verified = entry
            tokens = (
                [int(next_token[i])] if seen is None else [*verified[: seq_len[i] - seen - 1], next_token[i]]
            )
            if not all(m.consume_token(int(t)) for t in tokens):
                # the engine's own matcher meets the same token and raises with the request named
                self.error = f"request {req}: {m.get_error()}"
                continue
            entry[1], entry[2] = int(seq_len[i]), [int(d) for d in drafts[i]]
            if not m.is_stopped():
                fill.append((m, i * (k + 1), entry[2]))
        self._fill_rows(fill, out)
        self.seconds += time.perf_counter() - t0
        return out.reshape(b, k + 1, self.words)


# The in-step callback finds its scheduler's constraints by the key the step passes it: a step may
# run after the host call that dispatched it has returned, and two engines may serve at once.
_KEYS = itertools.count(1)
_BY_KEY: weakref.WeakValueDictionary[int, Constraints] = weakref.WeakValueDictionary()


def _callback(key, rows, seq_len, next_token, drafts) -> np.ndarray:
    constraints = _BY_KEY.get(int(key))
    if constraints is None:
        raise RuntimeError(f"a grammar-masked step ran after its constraints (key {int(key)}) were released")
    return constraints.callback_masks(
        np.asarray(rows), np.asarray(seq_len), np.asarray(next_token), np.asarray(drafts)
    )


def in_step_masks(
    key: jax.Array, rows: jax.Array, seq_len: jax.Array, next_token: jax.Array, drafts: jax.Array, vocab: int
):
    """Inside the step: the grammar masks [B, k+1, words] of rows ``rows`` [B] (request ids, -1 for
    none) from the :class:`Constraints` whose ``key`` ([] int32) the step was given, on the host,
    through an ordered io_callback (so successive steps ask in order)."""
    b, k = drafts.shape
    shape = jax.ShapeDtypeStruct((b, k + 1, words(vocab)), jnp.int32)
    return io_callback(_callback, shape, key, rows, seq_len, next_token, drafts, ordered=True)
