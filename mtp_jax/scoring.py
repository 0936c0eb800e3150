"""Teacher-forced passes of a loaded model over given tokens (:class:`TeacherForced`, a base of
:class:`mtp_jax.Model`): logits, prompt log-probabilities, hidden states, scores and a draft's
offline logits, and the checks of the token ids they take."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import mtp_jax.lora as lora
from mtp_jax.config import ModelConfig
from mtp_jax.errors import InvalidRequestError
from mtp_jax.request import SpeculativeConfig, step_config
from mtp_jax.sampling import MAX_LOGPROBS, TokenLogprobs, check_logprobs, token_logprobs
from mtp_jax.scheduler import TokenLogprob
from mtp_jax.sharding import replicated
from mtp_jax.step import StepConfig
from mtp_jax.targets import Hidden, target_for
from mtp_jax.targets.base import check_capture


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Log-probability of each token given the ones before it (the first token has none)."""

    token_ids: list[int]
    logprobs: list[float]

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


@functools.partial(jax.jit, static_argnames=("cfg", "capture", "mesh"))
def _teacher_forced(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    capture: tuple[int, ...],
    mesh: jax.sharding.Mesh | None = None,
    lora_slots: jax.Array | None = None,
):
    target = target_for(cfg)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    extra = {} if lora_slots is None else {"lora_slots": lora_slots}
    hidden, _ = target.forward(params, cfg, tokens, positions, capture=capture, mesh=mesh, **extra)
    # replicated: every process of a multi-host run can read the whole result
    return jax.tree.map(
        lambda x: replicated(x, mesh), (target.lm_head(params, hidden.post_norm, cfg), hidden)
    )


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def _prompt_logprobs(params, cfg, tokens, mesh=None, lora_slots=None) -> TokenLogprobs:
    """Each token's log-probability after the ones before it (tokens[:, 1:] at logits[:, :-1]),
    with the MAX_LOGPROBS most likely: only these leave the device, never the [B, T, V] logits."""
    logits, _ = _teacher_forced(params, cfg, tokens, (), mesh, lora_slots)
    return token_logprobs(logits[:, :-1], tokens[:, 1:], MAX_LOGPROBS)


@functools.partial(jax.jit, static_argnames=("sc",))
def _draft_logits(params: dict, sc: StepConfig, tokens: jax.Array) -> jax.Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = sc.target.forward(params, sc.cfg, tokens, positions, capture=sc.capture, mesh=sc.mesh)
    return replicated(sc.drafter.teacher_forced(params, sc.draft_context, tokens, hidden), sc.mesh)


def check_token_ids(ids: Sequence[int], where: str, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints in [0, ``vocab_size``); InvalidRequestError naming ``where``."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise InvalidRequestError(f"{where} must be a list of token ids, got {type(ids).__name__}")
    out = []
    for j, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise InvalidRequestError(f"{where}: token {j} is {tok!r}, not an integer id")
        if not 0 <= tok < vocab_size:
            raise InvalidRequestError(
                f"{where}: token id {int(tok)} at index {j} is outside [0, {vocab_size})"
            )
        out.append(int(tok))
    if not out:
        raise InvalidRequestError(f"{where} is empty; at least one token is needed")
    return out


def _check_batch(config: ModelConfig, token_ids: object) -> np.ndarray:
    """``token_ids`` as a non-empty int32 [batch, length] array of ``config``'s tokens."""
    arr = np.asarray(token_ids)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InvalidRequestError(
            f"token_ids must be a non-empty [batch, length] array, got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError(f"token_ids must hold integers, got dtype {arr.dtype}")
    bad = np.argwhere((arr < 0) | (arr >= config.vocab_size))
    if len(bad):
        b, t = bad[0]
        raise InvalidRequestError(
            f"token id {int(arr[b, t])} at [{b}, {t}] is outside [0, {config.vocab_size})"
        )
    if arr.shape[1] > config.max_position_embeddings:
        raise InvalidRequestError(
            f"sequence length {arr.shape[1]} exceeds max_position_embeddings {config.max_position_embeddings}"
        )
    return arr.astype(np.int32)


class TeacherForced:
    """The teacher-forced methods of :class:`mtp_jax.Model` (it provides ``config``, ``params``,
    ``mesh``, ``lora``, ``text``, ``drafts`` and ``default_draft``)."""

    def check_tokens(self, ids: Sequence[int], where: str) -> list[int]:
        """``ids`` as a list of ints, each a token of this model's vocabulary; InvalidRequestError
        naming ``where`` otherwise."""
        return check_token_ids(ids, where, self.config.vocab_size)

    def logits(self, token_ids: object, lora: str | None | Sequence[str | None] = None) -> np.ndarray:
        """Teacher-forced logits: int [B, T] -> float32 [B, T, V]. ``lora``: the LoRA adapter of
        every row, or one per row (None: the base model)."""
        tokens = _check_batch(self.config, token_ids)
        slots = self._lora_slots(lora, tokens.shape[0])
        logits, _ = _teacher_forced(self.params, self.config, tokens, (), self.mesh, slots)
        return np.asarray(logits)

    def prompt_logprobs(
        self, prompt: Sequence[int] | str, n: int = 0, lora: str | None = None
    ) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability after the tokens before it, with the ``n`` most
        likely tokens at its position (0 to MAX_LOGPROBS), from the target's raw distribution; None
        for the first token, which follows nothing (vLLM's ``prompt_logprobs``, what evaluation
        harnesses score log-likelihoods with). A string is encoded with the model's tokenizer
        under its BOS rules. ``lora``: the adapter the prompt is read with."""
        ids = self.check_tokens(
            self.text.encode(prompt) if isinstance(prompt, str) else list(prompt), "prompt"
        )
        n = check_logprobs("prompt_logprobs", n)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) > self.config.max_position_embeddings:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, beyond the model's maximum length "
                f"{self.config.max_position_embeddings}"
            )
        # right-padded to a power of two (causal: the padding changes nothing before it), so prompts
        # of similar lengths share one program
        padded = np.zeros((1, max(16, 1 << (len(ids) - 1).bit_length())), np.int32)
        padded[0, : len(ids)] = ids
        out = jax.tree.map(
            np.asarray,
            _prompt_logprobs(self.params, self.config, padded, self.mesh, self._lora_slots(lora, 1)),
        )
        rows: list[TokenLogprob | None] = [None]
        for t in range(len(ids) - 1):
            top = zip(out.top_ids[0, t, :n].tolist(), out.top[0, t, :n].tolist(), strict=True)
            rows.append(TokenLogprob(ids[t + 1], float(out.chosen[0, t]), tuple(top)))
        return rows

    def _lora_slots(self, names: str | None | Sequence[str | None], n: int) -> jax.Array | None:
        """Per-row adapter slots [n] of ``names`` (one for all, or one per row); None without LoRA."""
        if self.lora is None:
            if names is not None and (isinstance(names, str) or any(x is not None for x in names)):
                raise InvalidRequestError("this model has no LoRA adapters (load it with lora_adapters=...)")
            return None
        if names is None or isinstance(names, str):
            names = [names] * n
        if len(names) != n:
            raise InvalidRequestError(f"lora has {len(names)} values for {n} rows")
        return jnp.asarray(lora.check_names(names, self.lora.slots), jnp.int32)

    def hidden_states(self, token_ids: object, layers: Sequence[int] = ()) -> Hidden:
        """Hidden states [B, T, d] before and after the final norm, plus the outputs of ``layers``
        (layer i = output of decoder layer i, 0-based) stacked as [len(layers), B, T, d]."""
        capture = tuple(int(i) for i in layers)
        try:
            check_capture(self.config.num_hidden_layers, capture)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        _, hidden = _teacher_forced(
            self.params, self.config, _check_batch(self.config, token_ids), capture, self.mesh
        )
        return Hidden(*(None if h is None else np.asarray(h) for h in hidden))

    def score(self, token_ids: Sequence[int]) -> ScoreResult:
        """Per-token log-probabilities of one sequence (at least two tokens)."""
        ids = self.check_tokens(token_ids, "token_ids")
        if len(ids) < 2:
            raise InvalidRequestError("scoring needs at least two tokens (the first one is only context)")
        logits = self.logits([ids])[0]
        logp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
        picked = np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids[1:])[:, None], axis=-1))[:, 0]
        return ScoreResult(token_ids=ids, logprobs=[float(x) for x in picked])

    def draft_logits(self, token_ids: object, draft: str | None = None) -> np.ndarray:
        """The draft's teacher-forced logits over the TARGET vocabulary, to score a draft offline.

        MTP and EAGLE-3: int [B, T] -> float32 [B, T-1, V], the first draft step: row i reads the
        target's features at position i with token i+1 and predicts token i+2; ids outside the
        draft's vocabulary get -inf. DFlash: float32 [B, T, block_size - 1, V]: row i anchors a
        block at token i with the target features of positions 0..i-1 as context, and its entry j
        predicts token i + 1 + j. ``draft``: a method of :attr:`drafts` (default: the only one, else
        the separately loaded one, else "mtp")."""
        tokens = _check_batch(self.config, token_ids)
        if tokens.shape[1] < 2:
            raise InvalidRequestError("draft_logits needs sequences of at least two tokens")
        if draft is None:
            if not self.drafts:
                raise InvalidRequestError(f"{self.path or 'this model'} has no draft")
            draft = self.default_draft
        sc = step_config(self, SpeculativeConfig(draft, 1))
        return np.asarray(_draft_logits(self.params, sc, tokens))
