"""mtp_jax.drafts.teacher: the target's distribution a draft trains on, over its vocabulary."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mtp_jax.drafts.teacher import top_k_teacher


def test_the_truncated_teacher_by_hand():
    top_ids = jnp.array([[7, 2, 5, 0]])  # most likely first
    top_logp = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.05]]))
    # draft vocabulary {2, 5, 7}: draft ids 0, 1, 2; token 0 falls outside it
    t = top_k_teacher(top_ids, top_logp, jnp.array([2, 5, 7]), 8)
    np.testing.assert_allclose(np.asarray(t["probs"]), [[0.3 / 0.9, 0.2 / 0.9, 0.4 / 0.9]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(t["covered"]), [0.9], rtol=1e-6)
    assert int(t["greedy"][0]) == 7
    # over the whole vocabulary: the kept tokens renormalised, the rest zero
    full = top_k_teacher(top_ids, top_logp, None, 8)
    want = np.zeros(8)
    want[[7, 2, 5, 0]] = np.array([0.4, 0.3, 0.2, 0.05]) / 0.95
    np.testing.assert_allclose(np.asarray(full["probs"])[0], want, rtol=1e-6)
    # no kept token in the draft vocabulary: no teacher (zero weight), never NaN
    none = top_k_teacher(jnp.array([[0, 1]]), jnp.log(jnp.array([[0.6, 0.4]])), jnp.array([5]), 8)
    assert np.asarray(none["probs"]).tolist() == [[0.0]] and float(none["covered"][0]) == 0.0
