"""scripts/ngram_replay.py: walking a greedy reply as the n-gram step would, counted by hand."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO
from tests.scripts.test_train_tiny import import_script

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]
REPLY = [1, 2, 3, 4, 5, 6, 7, 8, 9, 20]  # repeats the prompt, then leaves it


@pytest.fixture(scope="module")
def replay():
    return import_script(os.path.join(REPO, "scripts", "ngram_replay.py")).replay


def test_three_token_suffixes(replay):
    """K = 3, suffixes 3..4. The prefill gives 1; no suffix of [.., 9, 1] or [.., 9, 1, 2] occurred
    before: two plain steps (2, 3). [1, 2, 3] did: drafts 4 5 6, all accepted, plus 7. Then
    [4, 5, 6, 7] (the longer suffix wins): drafts 8 9 1 against 8 9 20, two accepted, plus 20."""
    row = replay([{"prompt": PROMPT, "reply": REPLY}], 3, 3, 4)
    assert row["tokens"] == 9 and row["steps"] == 4
    assert (row["no_match_steps"], row["verifying_steps"], row["all_accepted_steps"]) == (2, 2, 1)
    assert row["acceptance_length"] == pytest.approx(9 / 4)


def test_four_token_suffixes(replay):
    """Suffixes of 4 only: [9, 1, 2, 3] did not occur either (a third plain step, 4); then [1, 2, 3, 4]:
    drafts 5 6 7 all accepted, plus 8; [5, 6, 7, 8]: drafts 9 1 2, one accepted, plus 20."""
    row = replay([{"prompt": PROMPT, "reply": REPLY}], 3, 4, 4)
    assert row["tokens"] == 9 and row["steps"] == 5
    assert (row["no_match_steps"], row["verifying_steps"], row["all_accepted_steps"]) == (3, 2, 1)
