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


def test_windows_drawn_source_by_source_follow_the_weights():
    """Three sources holding 77% / 15% / 8% of the tokens, weighed equally: each draws a third of
    the windows (within 5 standard deviations over 6,000), every window inside the stream, the same
    offsets again for the same (seed, step); bad weights are refused by name."""
    import pytest

    from mtp_jax.train.data import SourceWindows

    rng = np.random.default_rng(0)
    sources = list(rng.choice(["chat", "code", "math"], 300, p=[0.5, 0.3, 0.2]))
    length = {"chat": 400, "code": 120, "math": 60}
    sizes = np.asarray([length[s] + int(rng.integers(0, 20)) for s in sources])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    size = int(sizes.sum())
    windows = SourceWindows(starts, sources, size, {"chat": 1, "code": 1, "math": 1})
    offsets = np.concatenate([windows.offsets(size, 7, step, 60, 33) for step in range(100)])
    assert offsets.min() >= 0 and offsets.max() <= size - 34
    doc = np.searchsorted(starts, offsets, side="right") - 1
    drawn = np.asarray(sources)[doc]
    token_share = {s: sizes[np.asarray(sources) == s].sum() / size for s in length}
    assert token_share["chat"] > 0.7 and token_share["math"] < 0.1  # far from equal by tokens
    for name in length:
        share = np.mean(drawn == name)
        assert abs(share - 1 / 3) < 5 * np.sqrt(2 / 9 / len(drawn)), (name, share)
    np.testing.assert_array_equal(windows.offsets(size, 7, 3, 60, 33), windows.offsets(size, 7, 3, 60, 33))
    assert not np.array_equal(windows.offsets(size, 7, 3, 60, 33), windows.offsets(size, 7, 4, 60, 33))
    only = SourceWindows(starts, sources, size, {"chat": 0, "code": 1, "math": 0})
    doc = np.searchsorted(starts, only.offsets(size, 1, 0, 500, 33), side="right") - 1
    assert set(np.asarray(sources)[doc]) == {"code"}
    for bad in (
        {"chat": 1, "code": 1},
        {"chat": 1, "code": 1, "math": 1, "poetry": 1},
        dict.fromkeys(length, 0),
    ):
        with pytest.raises(ValueError, match="must give each of the data's sources"):
            SourceWindows(starts, sources, size, bad)


def test_continuations_are_kept_beside_a_run_whose_directory_does_not_exist_yet(tmp_path, monkeypatch):
    """A run's --out inside a folder not made yet (the DSpark smoke run's first write): the
    continuations are written there whole (no temporary left) and read back on a resume."""
    from mtp_jax.train import data

    made = np.arange(6, dtype=np.int32).reshape(2, 3)
    calls = []
    monkeypatch.setattr(data, "own_continuations", lambda *a: calls.append(a) or made)
    workdir = str(tmp_path / "new" / "draft.train")
    got = data.load_or_make_continuations(workdir, None, {}, np.zeros(9, np.int32), 2, 3, seed=0)
    np.testing.assert_array_equal(got, made)
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["draft.train.continuations-2x3-seed0.npy"]
    again = data.load_or_make_continuations(workdir, None, {}, np.zeros(9, np.int32), 2, 3, seed=0)
    np.testing.assert_array_equal(again, made)
    assert len(calls) == 1
