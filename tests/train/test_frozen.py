"""mtp_jax.train.frozen: a draft's run against a frozen target (end to end in tests/scripts/)."""

from __future__ import annotations

import numpy as np

from mtp_jax.train.frozen import draft_vocabulary


def test_draft_vocabulary_is_the_most_frequent_tokens_ascending():
    streams = [np.array([5, 5, 5, 2, 2, 9, 7, 7, 7, 7]), np.array([[9, 9], [1, 1]])]
    # counts: 7 -> 4, 5 -> 3, 9 -> 3, 2 -> 2, 1 -> 2; a tie keeps the lower id
    np.testing.assert_array_equal(draft_vocabulary(streams, 10, 3), [5, 7, 9])
    np.testing.assert_array_equal(draft_vocabulary(streams, 10, 4), [1, 5, 7, 9])
    assert draft_vocabulary(streams, 10, 4).dtype == np.int32
