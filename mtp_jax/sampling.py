"""Logits processing and sampling with per-row parameters and per-row randomness.

Processing order (the one ``transformers`` uses): temperature, then top-k, then top-p on what
top-k kept, then min-p. Rows with temperature 0 are greedy (argmax of the raw logits).

Randomness: the key of row b sampling the token at absolute position p is
``fold_in(key(seed_b), p)``, so a row's tokens never depend on its batch neighbours or its slot.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.errors import InvalidRequestError

MAX_DRAFTS = 16
MAX_LOGPROBS = 20
"""The most alternatives a request may ask log-probabilities of per token (OpenAI's top_logprobs
limit); a step that computes any computes this many (one program, whatever each request asks)."""
"""The most drafts a step verifies (num_speculative_tokens)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row decoding parameters, each [B]: temperature (0 = greedy), top_k (0 = off),
    top_p (1 = off), min_p (0 = off), seed (uint32); and how drafts are accepted for the row:
    num_speculative_tokens (the most drafts a step may accept; a step verifying fewer caps it), relaxed_topk
    (0 = strict acceptance) and relaxed_delta (:func:`relaxed_ok`, inside a thinking phase only);
    and the row's LoRA adapter slot, lora_slot (0 = none; :mod:`mtp_jax.lora`); and its tenant, the
    scheduler's number for its cache salt and adapter (rows of different tenants never see each
    other's text in engine-wide draft state: the suffix draft's index)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    num_speculative_tokens: jax.Array
    relaxed_topk: jax.Array
    relaxed_delta: jax.Array
    lora_slot: jax.Array
    tenant: jax.Array

    @classmethod
    def build(
        cls,
        batch: int,
        temperature: float | Sequence[float] = 0.0,
        top_k: int | Sequence[int] = 0,
        top_p: float | Sequence[float] = 1.0,
        min_p: float | Sequence[float] = 0.0,
        seed: int | Sequence[int] = 0,
        num_speculative_tokens: int | Sequence[int] = MAX_DRAFTS,
        relaxed_topk: int | Sequence[int] = 0,
        relaxed_delta: float | Sequence[float] = 0.0,
        lora_slot: int | Sequence[int] = 0,
        tenant: int | Sequence[int] = 0,
    ) -> RowSampling:
        """Validate scalar-or-per-row values and broadcast them to [batch]."""
        temperature = per_row("temperature", temperature, batch, float)
        top_k = per_row("top_k", top_k, batch, int)
        top_p = per_row("top_p", top_p, batch, float)
        min_p = per_row("min_p", min_p, batch, float)
        seed = per_row("seed", seed, batch, int)
        num_speculative_tokens = per_row("num_speculative_tokens", num_speculative_tokens, batch, int)
        relaxed_topk = per_row("relaxed_topk", relaxed_topk, batch, int)
        relaxed_delta = per_row("relaxed_delta", relaxed_delta, batch, float)
        lora_slot = per_row("lora_slot", lora_slot, batch, int)
        tenant = per_row("tenant", tenant, batch, int)
        named = {
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "seed": seed,
            "num_speculative_tokens": num_speculative_tokens,
            "relaxed_topk": relaxed_topk,
            "relaxed_delta": relaxed_delta,
            "lora_slot": lora_slot,
            "tenant": tenant,
        }
        for name, (values, given) in named.items():
            check_column(name, values, given)
        (
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            num_speculative_tokens,
            relaxed_topk,
            relaxed_delta,
            lora_slot,
            tenant,
        ) = (x[0] for x in named.values())
        # any k >= the vocabulary keeps everything, so huge values clamp safely into int32
        top_k = np.minimum(_as_column(top_k), 2**31 - 1)
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
            min_p=jnp.asarray(min_p, jnp.float32),
            seed=jnp.asarray(np.asarray(seed, np.uint32)),
            num_speculative_tokens=jnp.asarray(num_speculative_tokens, jnp.int32),
            relaxed_topk=jnp.asarray(relaxed_topk, jnp.int32),
            relaxed_delta=jnp.asarray(relaxed_delta, jnp.float32),
            lora_slot=jnp.asarray(lora_slot, jnp.int32),
            tenant=jnp.asarray(tenant, jnp.int32),
        )

    def pad(self, batch: int) -> RowSampling:
        """Extend to ``batch`` rows by repeating the last row (padding rows are discarded)."""
        extra = batch - self.temperature.shape[0]
        return jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], extra)]), self)


CHECKS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str]] = {
    "temperature": (lambda t: np.isfinite(t) & (t >= 0), "a finite number >= 0"),
    "top_k": (lambda k: k >= 0, ">= 0 (0 disables it)"),
    "top_p": (lambda p: (p > 0.0) & (p <= 1.0), "in (0, 1]"),
    "min_p": (lambda m: (m >= 0.0) & (m < 1.0), "in [0, 1)"),
    "seed": (lambda v: (v >= 0) & (v < 2**32), "in [0, 2**32)"),
    "num_speculative_tokens": (lambda k: (k >= 0) & (k <= MAX_DRAFTS), f"in [0, {MAX_DRAFTS}]"),
    "relaxed_topk": (lambda k: (k >= 0) & (k < 2**31), ">= 0 (0 disables it)"),
    "relaxed_delta": (lambda d: (d >= 0.0) & (d <= 1.0), "in [0, 1]"),
    "lora_slot": (lambda v: (v >= 0) & (v < 2**31), ">= 0"),
    "tenant": (lambda v: (v >= 0) & (v < 2**31), ">= 0"),
}
"""The range of each per-row sampling value, by the name requests give it: a test of an array of
values (elementwise, so that a batch of thousands of rows is checked at once)."""


def check_value(name: str, value: float, where: str = "") -> None:
    """InvalidRequestError unless ``value`` is in ``name``'s range (:data:`CHECKS`); ``where``
    ends the message (e.g. " (row 2)")."""
    ok, want = CHECKS[name]
    if not bool(ok(value)):  # a Python or numpy scalar: the test works on it as on a column
        raise InvalidRequestError(f"{name} must be {want}, got {value}{where}")


def check_column(name: str, values: Sequence[float], given: bool) -> None:
    """:func:`check_value` of every row of ``values`` (:func:`per_row`'s output) at once; the
    message names the first row out of range when the values were ``given`` per row."""
    ok, _ = CHECKS[name]
    column = _as_column(values)
    bad = np.flatnonzero(~np.asarray(ok(column), bool))
    if bad.size:
        i = int(bad[0])
        check_value(name, values[i], f" (row {i})" if given else "")


def _as_column(values: Sequence) -> np.ndarray:
    """``values`` as an array: of Python objects where some int does not fit int64."""
    return np.asarray(values, object if _beyond_int64(values) else None)


def _beyond_int64(values: Sequence) -> bool:
    """Whether some Python int of ``values`` does not fit int64 (numpy would refuse or wrap it)."""
    return any(type(v) is int and not -(2**63) <= v < 2**63 for v in values)


def check_logprobs(name: str, n: object, optional: bool = False) -> int | None:
    """``n`` alternatives per token as an int (None stays None when ``optional``), or
    InvalidRequestError naming ``name`` unless it is an integer in [0, MAX_LOGPROBS]."""
    if optional and n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_LOGPROBS:
        allowed = f"{'None or ' if optional else ''}an integer in [0, {MAX_LOGPROBS}]"
        raise InvalidRequestError(f"{name} must be {allowed}, got {n!r}")
    return int(n)


def per_row(name: str, value: object, batch: int, kind: type) -> tuple[list, bool]:
    """(values broadcast to [batch] as Python ``kind`` values, whether they were given per row):
    InvalidRequestError naming the row for a value that is not a number (or, for ints, not a whole
    one). A column of plain numbers is converted at once; anything else row by row."""
    given = isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim > 0)
    if not given:
        scalar = value.item() if isinstance(value, np.ndarray) else value
        return [_number(name, scalar, kind, "")] * batch, False
    values = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if len(values) != batch:
        raise InvalidRequestError(f"{name} has {len(values)} values for {batch} prompts")
    if all(type(v) in (int, float) for v in values) and not _beyond_int64(values):
        column = np.asarray(values, np.float64 if kind is float else None)
        if kind is float or column.dtype.kind in "iu":
            return column.tolist(), True
        whole = np.isfinite(column) & (column == np.floor(column))
        if whole.all():  # floats that are whole numbers: ints, as int(v) gives them
            return [int(v) for v in values], True
    return [_number(name, v, kind, f" (row {i})") for i, v in enumerate(values)], True


def _number(name: str, v: object, kind: type, where: str) -> float:
    """``v`` as a ``kind``, or InvalidRequestError unless it is a number (a whole one for int)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise InvalidRequestError(f"{name} must be a number, got {v!r}{where}")
    if kind is int and (not math.isfinite(v) or float(v) != int(v)):
        raise InvalidRequestError(f"{name} must be an integer, got {v!r}{where}")
    return kind(v)


TRUNCATION_CANDIDATES = (256, 4096)
"""How many of a row's largest values top-k / top-p thresholds are looked for in, in turn
(:func:`processed_logprobs`): a batch moves to the next count only when some row's top-k or
nucleus reaches past the last, and sorts its whole rows after the last. On SmolLM2's logits at
temperature 0.7 the top-p 0.9 / 0.95 nucleus has a median of 3 / 4 tokens and passes 256 in 0.4% /
1.3% of rows; 24 rows on a 2-core CPU: a selection of 256 about 4 ms, of 4096 about 32, the sort
about 216."""


@contextlib.contextmanager
def _set_while(flag: contextvars.ContextVar, on: bool) -> Iterator[None]:
    """``flag`` set to ``on`` inside the context (a trace-time switch), restored after it."""
    token = flag.set(on)
    try:
        yield
    finally:
        flag.reset(token)


_SORT_ONLY = contextvars.ContextVar("mtp_jax_sampling_sort_only", default=False)


def sort_only(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """While tracing inside this context (``on``), :func:`processed_logprobs` takes its top-k /
    top-p thresholds from the full sort, not the partial selection: XLA's SPMD partitioner does not
    split ``lax.top_k`` over rows, so on a mesh the selection would gather every row's logits onto
    every device. The step sets it for programs with a mesh; it is read at trace time only."""
    return _set_while(_SORT_ONLY, on)


_GREEDY_ONLY = contextvars.ContextVar("mtp_jax_sampling_greedy_only", default=False)


def greedy_only(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """While tracing inside this context (``on``), every row is taken to decode greedily
    (temperature 0): :func:`sample` is the argmax alone, :func:`draft_probs` its one-hot, and
    sampled acceptance is argmax acceptance, with no truncation, draw or ``cond`` between the two
    in the program. The tokens are those the general program gives such rows; only the program is
    smaller (about 30% less to trace, lower and compile). The step sets it for a
    :class:`mtp_jax.step.StepConfig` with ``greedy``; it is read at trace time only."""
    return _set_while(_GREEDY_ONLY, on)


def traced_greedy_only() -> bool:
    """Whether the program being traced decodes every row greedily (:func:`greedy_only`)."""
    return _GREEDY_ONLY.get()


def _top_k_sizes(params: RowSampling, vocab: int) -> jax.Array:
    return jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)


def sorted_thresholds(x: jax.Array, params: RowSampling) -> jax.Array:
    """Per row [B, 1], the smallest value top-k and top-p keep, from the whole row sorted: values
    >= the k-th largest, and of those the shortest prefix whose renormalised mass reaches p."""
    vocab = x.shape[-1]
    ordered = -jnp.sort(-x, axis=-1)  # descending
    k = _top_k_sizes(params, vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(before < params.top_p[:, None], axis=-1), 1)
    # the float32 running sum can reach 1 before the tail; top_p == 1 must keep the tail anyway
    n_keep = jnp.where(params.top_p >= 1.0, vocab, n_keep)
    pth = jnp.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)
    return jnp.maximum(kth, pth)


def candidate_thresholds(
    x: jax.Array, params: RowSampling, candidates: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`sorted_thresholds` from the ``candidates`` (default the first of
    :data:`TRUNCATION_CANDIDATES`) largest values of each row alone (a partial selection, no sort
    of the row), and per row [B] whether that is exact: its top-k fits the candidates, or it has
    no top-k and its nucleus ends inside them (its mass then taken against the whole row's
    normaliser)."""
    vocab = x.shape[-1]
    c = min(vocab, TRUNCATION_CANDIDATES[0] if candidates is None else candidates)
    top = jax.lax.top_k(x, c)[0]  # descending
    k = _top_k_sizes(params, vocab)
    kth = jnp.take_along_axis(top, (jnp.minimum(k, c) - 1)[:, None], axis=-1)
    kth = jnp.where((k <= c)[:, None], kth, -jnp.inf)  # past the candidates only k == V is exact: no cut
    ordered = jnp.where(jnp.arange(c)[None, :] < k[:, None], top, -jnp.inf)
    # top-p over the top-k survivors: normalised over them when all are candidates, else (no top-k)
    # over the whole row
    norm = jnp.where(k <= c, jax.nn.logsumexp(ordered, axis=-1), jax.nn.logsumexp(x, axis=-1))
    probs = jnp.exp(ordered - norm[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs
    count = jnp.sum(before < params.top_p[:, None], axis=-1)
    pth = jnp.take_along_axis(ordered, (jnp.maximum(count, 1) - 1)[:, None], axis=-1)
    pth = jnp.where((params.top_p >= 1.0)[:, None], -jnp.inf, pth)
    exact = (k <= c) | ((k == vocab) & ((params.top_p >= 1.0) | (count < c)))
    return jnp.maximum(kth, pth), exact


def processed_logprobs(logits: jax.Array, params: RowSampling) -> jax.Array:
    """Log-probabilities [B, V] (float32) of the processed distribution; removed tokens are -inf.

    Rows with temperature 0 are processed as temperature 1 (callers take the argmax for them).
    Ties at a top-k/top-p boundary keep every tied token.
    """
    logits = logits.astype(jnp.float32)
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)
    x = logits / temp[:, None]
    vocab = x.shape[-1]

    # Truncation by rank or mass needs the largest values in order. Most rows keep few tokens: their
    # thresholds come from a row's largest values (partial selections of TRUNCATION_CANDIDATES
    # sizes, in turn); the sort over the whole vocabulary (about 9 ms a row at 49k ids on a CPU)
    # runs only when some row's top-k or nucleus reaches past the last of them, and nothing runs
    # when no row truncates (min-p needs only the maximum).
    truncates = jnp.any((params.top_k > 0) & (params.top_k < vocab)) | jnp.any(params.top_p < 1.0)

    def truncated(x: jax.Array, tier: int = 0) -> jax.Array:
        if _SORT_ONLY.get() or tier == len(TRUNCATION_CANDIDATES):
            return sorted_thresholds(x, params)
        threshold, exact = candidate_thresholds(x, params, TRUNCATION_CANDIDATES[tier])
        if TRUNCATION_CANDIDATES[tier] >= vocab:  # every value a candidate: exact, nothing to fall back to
            return threshold
        return jax.lax.cond(jnp.all(exact), lambda x: threshold, lambda x: truncated(x, tier + 1), x)

    no_cut = lambda x: jnp.full((x.shape[0], 1), -jnp.inf, x.dtype)  # noqa: E731
    threshold = jax.lax.cond(truncates, truncated, no_cut, x)
    # min-p: keep tokens with prob >= min_p * max prob, i.e. logit >= max + log(min_p)
    top = jnp.max(x, axis=-1)
    mth = jnp.where(params.min_p > 0, top + jnp.log(jnp.maximum(params.min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(threshold, mth[:, None])
    x = jnp.where(x >= threshold, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


# Independent random streams per (seed, position). TARGET is what plain decoding uses, so
# speculative decoding with argmax drafts draws exactly the tokens plain sampling would.
TARGET, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities under the target's raw distribution (its logits' log-softmax, before
    temperature, top-k/p, min-p or a grammar's mask: vLLM's default "raw_logprobs") at a set of
    positions [...]: ``chosen`` [...] of the token emitted there, ``top_ids`` / ``top`` [..., n]
    the n most likely tokens and theirs, most likely first."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array, n: int) -> TokenLogprobs:
    """:class:`TokenLogprobs` of ``tokens`` [...] at their positions' ``logits`` [..., V], with the
    ``n`` most likely (computed in float32)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(lp, n)
    return TokenLogprobs(chosen, top_ids.astype(jnp.int32), top)


def row_keys(seed: jax.Array, positions: jax.Array, stream: int = TARGET) -> jax.Array:
    """Typed PRNG keys [B] from seeds [B] and absolute positions [B] (one stream of several)."""

    def one(s: jax.Array, p: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(s), p)
        return key if stream == TARGET else jax.random.fold_in(key, stream)

    return jax.vmap(one)(seed, positions)


def sample(logits: jax.Array, params: RowSampling, positions: jax.Array, stream: int = TARGET) -> jax.Array:
    """Next tokens [B] (int32) for logits [B, V]; ``positions`` [B] are the new tokens' positions."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if traced_greedy_only():
        return greedy

    def drawn() -> jax.Array:
        logp = processed_logprobs(logits, params)
        keys = row_keys(params.seed, positions, stream)
        return jnp.where(params.temperature > 0, jax.vmap(jax.random.categorical)(keys, logp), greedy)

    # an all-greedy batch skips the vocabulary sort and the draws entirely
    return jax.lax.cond(jnp.any(params.temperature > 0), drawn, lambda: greedy).astype(jnp.int32)


def repeat_rows(params: RowSampling, n: int) -> RowSampling:
    """Each row's parameters repeated n times ([B] -> [B·n], row-major), for [B, n, V] logits."""
    return jax.tree.map(lambda x: jnp.repeat(x, n), params)


def sample_positions(
    logits: jax.Array, params: RowSampling, first: jax.Array, stream: int = TARGET
) -> jax.Array:
    """Tokens [B, n] for logits [B, n, V] at positions first[b] + j, keyed like :func:`sample`."""
    b, n, v = logits.shape
    positions = (first[:, None] + jnp.arange(n)).reshape(-1)
    return sample(logits.reshape(b * n, v), repeat_rows(params, n), positions, stream).reshape(b, n)


def draft_probs(logits: jax.Array, params: RowSampling) -> jax.Array:
    """Processed draft distribution q [B, V] (float32); one-hot argmax for greedy rows."""
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if traced_greedy_only():
        return onehot
    q = jnp.exp(processed_logprobs(logits, params))
    return jnp.where(params.temperature[:, None] > 0, q, onehot)


def _leading_true(ok: jax.Array) -> jax.Array:
    """Number of leading True values per row of ok [B, K]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _below(cap: jax.Array | None, k: int, b: int) -> jax.Array:
    """[B, K]: whether draft j is within its row's cap (all True without one)."""
    if cap is None:
        return jnp.ones((b, k), bool)
    return jnp.arange(k)[None, :] < cap[:, None]


def accept_siblings(
    p: jax.Array,
    candidates: jax.Array,
    q: jax.Array,
    keys: jax.Array,
    given: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Multi-draft speculative sampling at one node of a token tree (SpecInfer's recursive
    rejection, in Sequoia's form that also covers candidates drawn without replacement): the token
    that follows a parent whose target distribution is ``p`` [R, V], given its children
    ``candidates`` [R, m] in proposal order, candidate i drawn from ``q`` [R, m, V] (its law given
    the candidates before it: the draft's distribution for candidates drawn with replacement,
    that distribution with the earlier candidates removed for candidates drawn without
    (:func:`without_replacement`), a one-hot for a fixed candidate such as the draft's top-m).

    Candidate i is accepted with probability min(1, r(c_i) / q_i(c_i)), r the residual, first p;
    on rejection r becomes normalize(max(r - q_i, 0)); if every candidate is rejected the token is
    drawn from the last residual. The token then follows p exactly, whatever q is. ``given``
    [R, m]: candidates that exist (others are skipped, as is one its law gives no mass: a draw
    without replacement from a distribution with fewer tokens than candidates). ``keys`` [R]:
    typed PRNG keys, one per row.
    Returns (index of the accepted candidate, -1 for none [R]; the token [R])."""
    r_rows, m = candidates.shape
    given = jnp.ones((r_rows, m), bool) if given is None else given
    split = jax.vmap(lambda k: jax.random.split(k, m + 1))(keys)  # [R, m + 1]
    residual = p.astype(jnp.float32)
    chosen = jnp.full((r_rows,), -1, jnp.int32)
    for i in range(m):
        c, q_i = candidates[:, i], q[:, i].astype(jnp.float32)
        r_c = jnp.take_along_axis(residual, c[:, None], axis=-1)[:, 0]
        q_c = jnp.take_along_axis(q_i, c[:, None], axis=-1)[:, 0]
        u = jax.vmap(jax.random.uniform)(split[:, i])
        open_ = (chosen < 0) & given[:, i] & (q_c > 0)  # a token its law cannot draw is no candidate
        # strict: u is drawn from [0, 1) and can be 0.0, which must not accept a token r gives no mass
        chosen = jnp.where(open_ & (u * q_c < r_c), i, chosen)
        rest = jnp.maximum(residual - q_i, 0.0)
        mass = rest.sum(-1, keepdims=True)
        rest = jnp.where(mass > 0, rest / jnp.maximum(mass, 1e-30), residual)  # r == q_i: never rejected
        residual = jnp.where((open_ & (chosen < 0))[:, None], rest, residual)
    fallback = jax.vmap(jax.random.categorical)(split[:, m], jnp.log(residual))
    picked = jnp.take_along_axis(candidates, jnp.maximum(chosen, 0)[:, None], axis=1)[:, 0]
    return chosen, jnp.where(chosen >= 0, picked, fallback).astype(jnp.int32)


def without_replacement(q: jax.Array, candidates: jax.Array) -> jax.Array:
    """The law of each of ``candidates`` [R, m] drawn one after another without replacement from
    ``q`` [R, V]: [R, m, V], row i being q with candidates 0..i-1 removed, renormalised."""
    m, v = candidates.shape[1], q.shape[-1]
    taken = jnp.cumsum(jax.nn.one_hot(candidates, v, dtype=jnp.float32), axis=1)  # [R, m, V]
    before = jnp.concatenate([jnp.zeros_like(taken[:, :1]), taken[:, : m - 1]], axis=1) > 0
    left = jnp.where(before, 0.0, q[:, None, :].astype(jnp.float32))
    return left / jnp.maximum(left.sum(-1, keepdims=True), 1e-30)


def relaxed_ok(
    target_logits: jax.Array, drafts: jax.Array, params: RowSampling, thinking: jax.Array
) -> jax.Array:
    """Relaxed acceptance [B, K] (lossy, for thinking phases): draft j passes when its row asks for
    it (relaxed_topk > 0), position j is inside a thinking phase (``thinking`` [B, K]) and, under
    the row's processed target distribution p at that position (temperature 1 for greedy rows), the
    draft is among the relaxed_topk most probable tokens with p(draft) >= p(top 1) - relaxed_delta.
    """
    b, k1, v = target_logits.shape
    k = k1 - 1
    logp = processed_logprobs(target_logits[:, :k].reshape(b * k, v), repeat_rows(params, k)).reshape(b, k, v)
    p = jnp.exp(logp)
    p_d = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    rank = jnp.sum(p > p_d[..., None], axis=-1)  # tokens strictly more probable than the draft
    topk = params.relaxed_topk[:, None]
    near = p_d >= p.max(axis=-1) - params.relaxed_delta[:, None]
    return (topk > 0) & thinking & (rank < topk) & near & (p_d > 0)


def accept_argmax_drafts(
    target_logits: jax.Array,
    drafts: jax.Array,
    params: RowSampling,
    first: jax.Array,
    cap: jax.Array | None = None,
    relaxed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Acceptance for drafts proposed without sampling (greedy rows, or ``draft_sampling="argmax"``).

    target_logits [B, K+1, V] predict positions first[b] + j; drafts [B, K]. Each position's token
    is drawn from the processed target distribution exactly as plain decoding would draw it (argmax
    for greedy rows); draft j is accepted while it equals that token, and the first disagreeing
    draw is emitted in its place. Lossless: this is speculative sampling with a one-hot proposal.
    ``cap`` [B] accepts at most cap[b] drafts (the token after them is drawn as above, so capping is
    exact); ``relaxed`` [B, K] (:func:`relaxed_ok`) also accepts the drafts it marks (lossy).
    Returns (emitted [B, K+1], n_accepted [B]); emitted[:, :n+1] are the new tokens.
    """
    y = sample_positions(target_logits, params, first)
    b, k = drafts.shape
    ok = y[:, :-1] == drafts
    if relaxed is not None:
        ok = ok | relaxed
    n = _leading_true(ok & _below(cap, k, b))
    if relaxed is not None:  # a relaxed acceptance emits the draft, not the target's draw
        y = jnp.where(jnp.arange(k + 1)[None] < n[:, None], jnp.concatenate([drafts, y[:, -1:]], axis=1), y)
    return y, n


def accept_sampled_drafts(
    target_logits: jax.Array,
    drafts: jax.Array,
    q: jax.Array,
    params: RowSampling,
    first: jax.Array,
    cap: jax.Array | None = None,
    relaxed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling (Leviathan et al. / Chen et al.) for drafts drawn from q [B, K, V].

    Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), p the processed target
    distribution; at the first rejection a token is drawn from normalize(max(0, p_j - q_j)); if all
    K are accepted a bonus token is drawn from p_K. Greedy rows fall back to argmax acceptance.
    ``cap`` [B]: drafts from cap[b] on are treated as never proposed (rejected, and the token there
    drawn from p itself exactly as plain decoding draws it), which keeps the output exact; a row
    capped at 0 is plain sampling, token for token; ``relaxed`` as in
    :func:`accept_argmax_drafts`. Returns (emitted [B, K+1], n_accepted [B]).
    """
    if traced_greedy_only():  # what the general program gives greedy rows, alone
        return accept_argmax_drafts(target_logits, drafts, params, first, cap, relaxed)
    b, k1, v = target_logits.shape
    k = k1 - 1
    below = _below(cap, k, b)
    if cap is not None:
        q = jnp.where(below[..., None], q, 0.0)
    p = jnp.exp(processed_logprobs(target_logits.reshape(b * k1, v), repeat_rows(params, k1))).reshape(
        b, k1, v
    )
    positions = first[:, None] + jnp.arange(k1)
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.random.uniform)(
        row_keys(jnp.repeat(params.seed, k), positions[:, :k].reshape(-1), ACCEPT)
    )
    # P(u q < p) = min(1, p / q) for u uniform on [0, 1); strict, since u can be 0.0 and a draft the
    # target gives no mass must never be accepted
    accepted = u.reshape(b, k) * q_d < p_d
    if relaxed is not None:
        accepted = accepted | relaxed
    n_acc = _leading_true(accepted & below)
    residual = jnp.concatenate([jnp.maximum(p[:, :k] - q, 0.0), p[:, k:]], axis=1)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual, p)  # p == q: any rejection has probability 0
    keys = row_keys(jnp.repeat(params.seed, k1), positions.reshape(-1), RESIDUAL)
    z = jax.vmap(jax.random.categorical)(keys, jnp.log(residual.reshape(b * k1, v))).reshape(b, k1)
    fix = jnp.take_along_axis(z, n_acc[:, None], axis=1)
    if cap is not None:  # stopped by its cap, a row draws the next token as plain decoding does
        plain = jnp.take_along_axis(sample_positions(target_logits, params, first), n_acc[:, None], axis=1)
        fix = jnp.where(((n_acc == cap) & (cap < k))[:, None], plain, fix)
    emitted = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
    emitted = jnp.where(jnp.arange(k1)[None] == n_acc[:, None], fix, emitted).astype(jnp.int32)
    greedy_emitted, greedy_n = accept_argmax_drafts(target_logits, drafts, params, first, cap, relaxed)
    stochastic = params.temperature > 0
    return (jnp.where(stochastic[:, None], emitted, greedy_emitted), jnp.where(stochastic, n_acc, greedy_n))
