"""mtp_jax.Model: the target's parameters and each draft's kept beside each other, and drafts
swapped over one loaded target (Model.with_draft) without reloading or copying it."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import mtp_jax
from tests.conftest import EMBEDDED_MODEL, REPO

DFLASH = os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-stdlib-dflash")
EAGLE3 = os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-stdlib-eagle3")
PROMPTS = [[0, 17, 42, 5, 9], [0, 3, 3, 8]]


@pytest.fixture(scope="module")
def base() -> mtp_jax.Model:
    return mtp_jax.load(EMBEDDED_MODEL, "float32")


def test_draft_parameters_travel_beside_the_targets(base):
    assert set(base.draft_params) == {"mtp"}  # the target's own MTP layer is a draft too
    assert not {"mtp", "eagle3", "dflash", "draft_model"} & set(base.target_params)
    assert {"embed", "final_norm"} <= set(base.target_params)
    # the step's view holds both, the same device arrays
    assert set(base.params) == set(base.target_params) | set(base.draft_params)
    assert (
        base.params["embed"] is base.target_params["embed"] and base.params["mtp"] is base.draft_params["mtp"]
    )


def test_drafts_swap_over_one_loaded_target(base):
    with_dflash = base.with_draft(DFLASH)
    with_eagle3 = with_dflash.with_draft(EAGLE3)  # replaces the separate draft, keeps the MTP layer
    assert set(with_dflash.draft_params) == {"mtp", "dflash"}
    assert set(with_eagle3.draft_params) == {"mtp", "eagle3"}
    assert set(base.draft_params) == {"mtp"} and base.draft_config is None  # left as it was
    for model in (with_dflash, with_eagle3):  # the target is shared, not copied
        for a, b in zip(
            jax.tree.leaves(model.target_params), jax.tree.leaves(base.target_params), strict=True
        ):
            assert a is b
    plain = base.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    for model, draft, path in ((with_dflash, "dflash", DFLASH), (with_eagle3, "eagle3", EAGLE3)):
        assert model.default_draft == draft and set(model.drafts) == {"mtp", draft}
        out = model.generate(
            PROMPTS, max_new_tokens=12, ignore_eos=True, draft=draft, num_speculative_tokens=3
        )
        assert out.tokens == plain.tokens and out.stats["acceptance_length"] > 1.1, draft
        # the same as loading the target with the draft
        loaded = mtp_jax.load(EMBEDDED_MODEL, "float32", draft_model=path)
        np.testing.assert_array_equal(model.draft_logits(PROMPTS[:1]), loaded.draft_logits(PROMPTS[:1]))
    mtp = with_eagle3.generate(
        PROMPTS, max_new_tokens=12, ignore_eos=True, draft="mtp", num_speculative_tokens=2
    )
    assert mtp.tokens == plain.tokens


def test_with_draft_refuses_what_load_refuses(base, tmp_path):
    with pytest.raises(mtp_jax.CheckpointNotFoundError, match="draft model directory not found"):
        base.with_draft(tmp_path / "missing")
    with pytest.raises(ValueError, match="layer_ids must be one of"):
        base.with_draft(EAGLE3, layer_ids="middle")
