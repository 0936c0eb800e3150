"""DSpark's small heads over the block's outputs h_k (the backbone's norm(x) at slot k) and the
previous token x_{k-1} (the anchor for slot 0): the sequential head's logit bias and the confidence
head (paper Eq. 5-7; docs/formats.md, "DSpark drafts").

Parameters (``params["dspark"]``; weights [in, out])::

    markov: {w1 [V, r] (looked up by x_{k-1}), w2 [r, V]}          (markov_rank r > 0)
            + gated: {gate [d + r, r], gate_bias [r]}
            + rnn:   {joint [r + r + d, 3r], joint_bias [3r]}       (input [s_{k-1}; W1[x]; h_k])
    confidence: {w [d (+ r)], b []}                                  (input [h_k; W1[x]])

Per slot (``state`` s is the RNN's, zero at every block's start)::

    vanilla: bias = W1[x] W2
    gated:   bias = (sigmoid([h; W1[x]] G + g) * W1[x]) W2
    rnn:     (a, c, o) = split3([s; W1[x]; h] J + j);  s' = sigmoid(a) s + (1 - sigmoid(a)) tanh(c)
             bias = tanh(o) W2
    confidence logit = [h; W1[x]] · w + b, divided by the slot's calibration temperature
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.drafts.dspark.config import DSparkConfig


def initial_state(cfg: DSparkConfig, batch_shape: tuple[int, ...]) -> jax.Array:
    """The RNN head's state at a block's start (zeros [..., r]; [..., 0] for the other heads)."""
    r = cfg.markov_rank if cfg.markov_head_type == "rnn" else 0
    return jnp.zeros(batch_shape + (r,), jnp.float32)


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def markov_step(
    p: dict, cfg: DSparkConfig, h: jax.Array, prev: jax.Array, state: jax.Array
) -> tuple[jax.Array | None, jax.Array]:
    """The sequential head at one slot: h [..., d], previous tokens prev [...] (target ids), the
    RNN state [..., r]. Returns (the float32 logit bias [..., V], or None without a head, and the
    next state)."""
    if cfg.markov_rank == 0:
        return None, state
    m = p["markov"]
    e = _f32(m["w1"][prev])  # [..., r]
    if cfg.markov_head_type == "vanilla":
        u = e
    elif cfg.markov_head_type == "gated":
        gate = jnp.concatenate([_f32(h), e], -1) @ _f32(m["gate"]) + _f32(m["gate_bias"])
        u = jax.nn.sigmoid(gate) * e
    else:
        joint = jnp.concatenate([state, e, _f32(h)], -1) @ _f32(m["joint"]) + _f32(m["joint_bias"])
        a, c, o = jnp.split(joint, 3, axis=-1)
        keep = jax.nn.sigmoid(a)
        state = keep * state + (1 - keep) * jnp.tanh(c)
        u = jnp.tanh(o)
    return u @ _f32(m["w2"]), state


def confidence_logit(p: dict, cfg: DSparkConfig, h: jax.Array, prev: jax.Array, slot: int) -> jax.Array:
    """The confidence head's float32 logit [...] at block slot ``slot`` (0-based), calibrated by
    the slot's temperature and shift when the draft has them: sigmoid of it is the probability
    that the slot's draft is accepted given that the slots before it were."""
    c = p["confidence"]
    x = _f32(h)
    if cfg.markov_rank > 0 and cfg.confidence_with_markov:
        x = jnp.concatenate([x, _f32(p["markov"]["w1"][prev])], -1)
    z = x @ _f32(c["w"]) + _f32(c["b"])
    temps, shifts = cfg.confidence_temperatures, cfg.confidence_shifts
    z = z if temps is None else z / temps[slot]
    return z if shifts is None else z + shifts[slot]


def teacher_forced_heads(
    p: dict,
    cfg: DSparkConfig,
    h: jax.Array,
    base: jax.Array,
    prev: jax.Array,
    known: jax.Array | None = None,
    draft_to_target: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Every slot of blocks at once with the previous tokens given (training's teacher forcing):
    h [..., B, d], base logits [..., B, V], prev [..., B] (the anchor, then the true tokens, target
    ids); ``known`` [..., B] (default: all): where False, slot k's previous token is instead the
    argmax of slot k - 1's biased logits (greedy decoding's, past a sequence's end). With a draft
    vocabulary (``draft_to_target`` [Vd]) the logits are over it and that argmax is mapped to its
    target id. Returns (the biased logits [..., B, V or Vd], confidence logits [..., B] or None)."""
    logits, conf = [], []
    state, last = initial_state(cfg, h.shape[:-2]), prev[..., 0]
    for k in range(h.shape[-2]):
        x = prev[..., k] if known is None else jnp.where(known[..., k], prev[..., k], last)
        if cfg.confidence_head:
            conf.append(confidence_logit(p, cfg, h[..., k, :], x, k))
        bias, state = markov_step(p, cfg, h[..., k, :], x, state)
        logits.append(base[..., k, :] if bias is None else base[..., k, :] + bias)
        last = jnp.argmax(logits[-1], -1).astype(prev.dtype)
        if draft_to_target is not None:
            last = draft_to_target[last].astype(prev.dtype)
    return jnp.stack(logits, -2), (jnp.stack(conf, -1) if conf else None)
