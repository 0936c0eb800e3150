"""mtp_jax.train.data: the training text and a target's own continuations."""

from __future__ import annotations

import numpy as np

from mtp_jax.train.data import own_continuations


def test_own_continuations_are_a_training_prompt_then_the_models_greedy_text(tiny_model):
    vocab = tiny_model.config.vocab_size
    stream = np.random.default_rng(0).integers(2, vocab, 400).astype(np.int32)
    length, cut_max = 40, 17  # prompts of 16..max(17, length // 4) tokens
    windows = own_continuations(
        tiny_model.config, tiny_model.params, stream, 3, length, seed=0, num_speculative_tokens=0
    )  # plain decoding: compiles faster; speculative greedy output equals it (tests/test_spec.py)
    assert windows.shape == (3, length) and windows.dtype == np.int32
    starts = [
        [s for s in range(len(stream) - 16) if np.array_equal(stream[s : s + 16], w[:16])] for w in windows
    ]
    assert all(starts), "every window starts with a passage of the training stream"
    assert len({tuple(w) for w in windows}) == 3
    for w in windows:
        # from the longest prompt on, each token is the model's argmax given the window before it
        greedy = np.argmax(tiny_model.logits([w.tolist()])[0], axis=-1)
        np.testing.assert_array_equal(greedy[cut_max - 1 : -1], w[cut_max:])
        assert not np.array_equal(greedy[:15], w[1:16])  # the prompt is the stream's, not greedy
