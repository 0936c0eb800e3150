"""What the scheduler holds per request: the request itself (its prompt, sampling row, hooks, tokens
and timestamps), its speculation counters, its tokens' log-probabilities, the pages it owns, and what
:func:`mtp_jax.scheduler.generate` returns."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mtp_jax.request import CheckedRequest, row_sampling
from mtp_jax.sampling import RowSampling
from mtp_jax.step import StepConfig

TokenCallback = Callable[[int, int], None]
"""Called as ``on_token(prompt_index, token_id)`` for every emitted token, in order."""
VerifiedCallback = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
"""Called as ``on_verified(confidence_logits [n, K], verified [n], accepted [n])`` after each step
(:class:`Scheduler`)."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's raw distribution at its position (the
    logits' log-softmax, before temperature, top-k/p, min-p or a grammar), and the request's
    ``logprobs`` most likely tokens there with theirs, most likely first: ``top`` ((id, logprob), ...).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class GenerateResult:
    """New tokens per prompt (EOS included when it stopped the row), why each row stopped
    ("eos", "length", "stop": a stop string or id, or "grammar": its grammar admits nothing
    more), run statistics, per prompt its speculation statistics (:class:`SpecCounters`), and
    with text prompts or stop strings each request's new text. ``logprobs``: per prompt that asked
    (``SamplingParams.logprobs``), one :class:`TokenLogprob` per new token (None for the others);
    ``prompt_logprobs``: per prompt that asked, one per prompt token (None for the first, which
    follows nothing). Each request's stats also hold its latencies (:meth:`Request.timings`)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict
    request_stats: list[dict] = dataclasses.field(default_factory=list)
    texts: list[str] | None = None
    logprobs: list[list[TokenLogprob] | None] | None = None
    prompt_logprobs: list[list[TokenLogprob | None] | None] | None = None


class SpecCounters:
    """Speculation counters of a request or of a whole run, named as serving engines export them:
    steps (verification steps), num_drafts (steps that verified at least one draft),
    num_draft_tokens, num_accepted_tokens and num_accepted_tokens_per_pos[j] (steps that accepted
    draft j, 0-based: with a token tree, a node of depth j + 1); steps_per_verified_drafts[n]: steps
    that verified n drafts (the lengths a confidence schedule chose, the caps, or with suffix
    decoding's dynamic trees the sizes of the rows' trees);
    expected_accepted_tokens: with a draft that estimates its confidence (in a single-process run),
    the accepted drafts its calibrated confidences expected (the sum over verified drafts of their
    running products: set against num_accepted_tokens, the calibration's check);
    drafts_by_source: with a draft of several :attr:`~mtp_jax.drafts.Draft.sources` (suffix
    decoding, the hybrid; a single-process run), for each source ("none": no proposal) the
    row-steps whose drafts came from it, their drafts verified and their drafts accepted."""

    def __init__(self, k: int, drafts: int | None = None) -> None:
        """``k``: the drafts a step can accept (a tree's depth); ``drafts``: that it can verify (a
        tree's nodes; default ``k``)."""
        self.steps = self.emitted = self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.per_pos = np.zeros(k, np.int64)
        self.per_length = np.zeros((k if drafts is None else drafts) + 1, np.int64)
        self.expected = 0.0
        self.by_source: dict[str, list[int]] = {}

    def add(self, drafted: int, emitted: int, expected: float = 0.0, source: str | None = None) -> None:
        if source is not None:
            counts = self.by_source.setdefault(source, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + drafted, counts[2] + emitted - 1
        self.steps += 1
        self.expected += expected
        self.per_length[min(drafted, len(self.per_length) - 1)] += 1
        self.emitted += emitted
        self.num_drafts += drafted > 0
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += emitted - 1
        self.per_pos[: emitted - 1] += 1

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "acceptance_length": self.emitted / steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": self.per_pos.tolist(),
            "steps_per_verified_drafts": self.per_length.tolist(),
            "acceptance_rate_per_position": [float(x) / steps for x in self.per_pos],
            "draft_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "expected_accepted_tokens": self.expected,
            **({"drafts_by_source": self.sources()} if self.by_source else {}),
        }

    def sources(self) -> dict[str, dict[str, int]]:
        """``drafts_by_source``: {source: {"steps", "drafts", "accepted"}}, sources in name order."""
        keys = ("steps", "drafts", "accepted")
        return {name: dict(zip(keys, self.by_source[name], strict=True)) for name in sorted(self.by_source)}


TIMINGS = ("time_to_first_token_seconds", "time_per_output_token_seconds")
"""The latencies :meth:`Request.timings` reports (seconds); a generate call's stats hold their means
(``mean_time_to_first_token_seconds``, ...)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One request in a :class:`Scheduler`: its prompt, how many new tokens at most, its sampling
    row (:class:`RowSampling` of one row), and where its tokens go: ``on_token(token)`` for each
    (returning True stops the request: finish reason "stop"), ``on_finish(request)`` at the end.
    The scheduler fills in ``tokens``, ``finish`` ("eos", "stop", "grammar", "length" or
    "cancelled") and ``counters``; with ``logprobs`` (how many alternatives, 0 to MAX_LOGPROBS)
    also ``token_logprobs``, each token's before ``on_token`` is called for it. ``cache_salt``
    separates cached prefixes (:class:`mtp_jax.cache.PrefixCache`): only requests with equal salts
    (and LoRA slots) share pages; whoever builds requests changes it when the weights that
    computed a prefix change (an adapter reloaded into the same slot). ``submitted_at``,
    ``first_token_at`` and ``finished_at`` (:func:`time.perf_counter` seconds) are filled in as the
    scheduler queues the request, hands it its first token and finishes it: :meth:`timings`."""

    prompt: list[int]
    max_new_tokens: int
    sampling: RowSampling
    on_token: Callable[[int], bool | None] | None = None
    on_finish: Callable[[Request], None] | None = None
    id: int = -1
    ignore_eos: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str = ""
    counters: SpecCounters | None = None
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    cache_salt: bytes = b""
    submitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @classmethod
    def from_checked(
        cls, checked: CheckedRequest, id: int, sampling: RowSampling | None = None, **fields: Any
    ) -> Request:
        """The scheduler's request for a checked one (:func:`mtp_jax.request.check_request`): the one
        construction ``generate``, the offline :func:`generate` and the serving engine share.
        ``sampling``: its row, when the caller built every row at once (default: its own);
        ``fields``: the rest (hooks, timestamps)."""
        params = checked.params
        return cls(
            checked.prompt,
            params.max_new_tokens,
            row_sampling([checked]) if sampling is None else sampling,
            id=id,
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
            cache_salt=b"" if params.cache_salt is None else b"salt:" + params.cache_salt.encode(),
            **fields,
        )

    def add_token(self, tok: int, logprobs=None, i: int = 0) -> None:
        """Append a new token; with ``logprobs`` (host TokenLogprobs arrays), its log-probability
        from their row ``i`` when the request asked for them."""
        self.tokens.append(tok)
        if self.logprobs is not None and logprobs is not None:
            n = self.logprobs
            top = zip(logprobs.top_ids[i, :n].tolist(), logprobs.top[i, :n].tolist(), strict=True)
            self.token_logprobs.append(TokenLogprob(tok, float(logprobs.chosen[i]), tuple(top)))

    def timings(self) -> dict:
        """Its latencies as serving engines report them, in seconds (None where not reached yet):
        ``time_to_first_token_seconds`` (queued to first token: waiting, prefill) and
        ``time_per_output_token_seconds`` (first token to the last, over the tokens after the
        first: decoding alone; None with fewer than two). Tokens are timed when the host reads
        them, a step after they were dispatched."""
        ttft = tpot = None
        if self.first_token_at is not None and self.submitted_at is not None:
            ttft = self.first_token_at - self.submitted_at
        if self.first_token_at is not None and self.finished_at is not None and len(self.tokens) > 1:
            tpot = (self.finished_at - self.first_token_at) / (len(self.tokens) - 1)
        return dict(zip(TIMINGS, (ttft, tpot), strict=True))


def lora_slot(req: Request) -> int:
    """The LoRA adapter slot a request decodes with (0: none)."""
    return int(np.asarray(req.sampling.lora_slot)[0])


def pages_needed(prompt_len: int, max_new_tokens: int, sc: StepConfig) -> int:
    """Cache pages a request owns: its prompt, its new tokens and the speculative overshoot of the
    last steps (target rows up to K ahead, MTP rows up to 2K ahead, one step read late; a dynamic
    tree's scratch rows, :attr:`mtp_jax.step.StepConfig.overshoot`)."""
    return math.ceil((prompt_len + max_new_tokens + 2 * (sc.overshoot + 1)) / sc.page_size)


def logprob_rows(logprobs, index):
    """The host TokenLogprobs ``logprobs`` (or None) at ``index`` of their leading axes."""
    return None if logprobs is None else jax.tree.map(lambda x: x[index], logprobs)
