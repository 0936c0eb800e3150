"""The MTP/NextN draft layer against transformers' MTP implementation (fixtures with an MTP layer)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.cache import init_pages, page_table_array, slots_for
from mtp_jax.drafts.mtp import mtp_forward
from mtp_jax.models.deepseek_v3 import PagedAttention
from tests.conftest import PARITY_DIR


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=["fp8_mtp", "sharded_mtp_bf16"])
def case(request):
    path = os.path.join(PARITY_DIR, request.param)
    weights = "fp8" if request.param.startswith("fp8") else "dense"
    return mtp_jax.load(path, "float32", weights=weights), np.load(os.path.join(path, "reference.npz"))


def test_mtp_teacher_forced_matches_transformers(case):
    model, ref = case
    ids = ref["input_ids"]
    hidden = model.hidden_states(ids).post_norm
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t - 1), (b, t - 1))
    args = (model.params, model.config, jnp.asarray(ids[:, 1:]), jnp.asarray(hidden[:, :-1]), pos)
    out = mtp_forward(*args, dispatch="sorted")
    assert rel_err(out.logits, ref["mtp_logits"]) < 1e-4
    assert rel_err(out.state, ref["mtp_hidden"]) < 1e-4
    dense = mtp_forward(*args, dispatch="dense")  # the training path
    assert rel_err(dense.logits, ref["mtp_logits"]) < 1e-4
    assert float(out.expert_load.sum()) == b * (t - 1) * model.config.num_experts_per_tok


def test_mtp_paged_in_chunks_matches_transformers(case):
    """The serving form: rows written to the MTP layer's own paged cache a few at a time."""
    model, ref = case
    ids = ref["input_ids"]
    hidden = jnp.asarray(model.hidden_states(ids).post_norm)
    b, t = ids.shape
    page = 4
    width = -(-t // page)
    table = jnp.asarray(page_table_array([list(range(i, b * width, b)) for i in range(b)], width))
    pages = init_pages(model.config, b * width, page, jnp.float32)["moe"][0]
    got = []
    for lo, hi in [(0, 5), (5, 6), (6, t - 1)]:
        pos = jnp.broadcast_to(jnp.arange(lo, hi), (b, hi - lo))
        paged = PagedAttention(pages, slots_for(table, pos, jnp.ones(pos.shape, bool), page), table)
        out = mtp_forward(
            model.params, model.config, jnp.asarray(ids[:, lo + 1 : hi + 1]), hidden[:, lo:hi], pos, paged
        )
        pages = out.pages
        got.append(np.asarray(out.logits))
    assert rel_err(np.concatenate(got, axis=1), ref["mtp_logits"]) < 1e-4
