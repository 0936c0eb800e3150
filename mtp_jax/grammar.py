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

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.errors import InvalidRequestError

KINDS = ("json_schema", "regex", "lark")


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
    """The matchers of one generate call: one per constrained request, on the model's tokenizer."""

    def __init__(
        self,
        tokenizer_path: str | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        specs: Sequence[object],
    ) -> None:
        llg = _llguidance()
        if tokenizer_path is None or not os.path.isfile(tokenizer_path):
            raise InvalidRequestError("grammar-constrained decoding needs the model's tokenizer.json")
        if not eos_token_ids:
            raise InvalidRequestError("grammar-constrained decoding needs the model's EOS token id")
        self.tokenizer = llg.LLTokenizer(tokenizer_path, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.words = words(vocab_size)
        self.grammars: list[str | None] = []
        for i, spec in enumerate(specs):
            if spec is None:
                self.grammars.append(None)
                continue
            try:
                text = grammar_text(spec)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"grammar of prompt {i}: {e}") from None
            error = llg.LLMatcher.validate_grammar(text, self.tokenizer)
            if error and not error.startswith("WARNING"):
                raise InvalidRequestError(f"grammar of prompt {i} is invalid: {' '.join(error.split())}")
            self.grammars.append(text)
        self.matchers: dict[int, Any] = {}
        self._executor = llg.LLExecutor()
        self._fill_along = llg.numpy.fill_next_token_bitmask_par_with_draft_tokens
        self._fill = llg.numpy.fill_next_token_bitmask_par
        self.seconds = 0.0  # host time in consume() and masks()

    def constrained(self, req: int) -> bool:
        return self.grammars[req] is not None

    def start(self, req: int, prompt: Sequence[int]) -> None:
        """A fresh matcher for request ``req`` (the grammar constrains the new tokens only)."""
        llg = _llguidance()
        self.matchers[req] = llg.LLMatcher(self.tokenizer, self.grammars[req], log_level=0)

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
        self.matchers.pop(req, None)

    def masks(self, rows: Sequence[tuple[int, int, Sequence[int]]], shape: tuple[int, ...]) -> np.ndarray:
        """Bitmasks [*shape, words] (all ones where unconstrained) for rows (request, flat index of
        the first position, drafts): position j after the committed text and drafts[:j]."""
        t0 = time.perf_counter()
        out = np.full((int(np.prod(shape)), self.words), -1, np.int32)
        along, alone = [], []
        for req, index, drafts in rows:
            m = self.matchers[req]
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
        self.seconds += time.perf_counter() - t0
        return out.reshape(*shape, self.words)
