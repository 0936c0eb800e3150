"""The shipped drafts (checkpoints/*-eagle3 by scripts/train_eagle3.py, checkpoints/*-dflash by
scripts/train_dflash.py, checkpoints/*-dspark by scripts/train_dspark.py) are what their cards say:
published-layout drafts that load strictly beside their targets, are accepted often enough that
every acceptance length occurs, and leave greedy output exactly plain decoding's."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from tests.conftest import EMBEDDED_MODEL, REPO

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
TARGETS = {"llama": LLAMA, "deepseek": EMBEDDED_MODEL}
# (target, draft method): the K values checked for losslessness besides K = 3 (DFlash: the block's
# first row, and a whole trained block)
CASES = {
    ("llama", "eagle3"): [(1, None), (5, None)],
    ("deepseek", "eagle3"): [(1, None), (5, None)],
    ("llama", "dflash"): [(1, None), (15, None)],
    ("deepseek", "dflash"): [(1, None), (15, None)],
    ("llama", "dspark"): [(1, None), (7, None)],
    ("deepseek", "dspark"): [(1, None), (7, None)],
}
_PLAIN: dict[str, list] = {}


@pytest.fixture(scope="module", params=sorted(CASES), ids="-".join)
def shipped(request):
    name, method = request.param
    target = TARGETS[name]
    draft = f"{target}-{method}"
    model = mtp_jax.load(target, "float32", strict=True, draft_model=draft)
    tok = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))
    with open(os.path.join(draft, "eval.json"), encoding="utf-8") as f:
        report = json.load(f)
    prompts = [tok.encode(t).ids for t in report["prompts"]]
    if name not in _PLAIN:  # plain decoding once per target: the drafts' prompts are the target's
        _PLAIN[name] = model.generate(prompts, max_new_tokens=64, max_batch=len(prompts)).tokens
    return name, method, model, report, prompts, draft, _PLAIN[name]


def test_is_a_published_layout_draft(shipped):
    name, method, model, report, _, draft, _ = shipped
    cfg = model.draft_config
    keys = set(CheckpointReader(draft).keys())
    # the target's embedding is used (DeepSpec's layout stores a frozen copy, checked at load)
    assert ("embed_tokens.weight" in keys) == (method == "dspark")
    if method == "dspark":
        with open(os.path.join(draft, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        assert raw["architectures"] == ["Qwen3DSparkModel"] and cfg.confidence_head
        assert {"markov_head.markov_w1.weight", "confidence_head.proj.weight", "fc.weight"} <= keys
        assert (
            cfg.markov_rank == report["draft"]["markov_rank"]
            and list(cfg.capture) == report["draft"]["layer_ids"]
        )
        # calibrated on rollouts: the temperatures it shipped with are the ones its report fitted
        assert list(cfg.confidence_temperatures) == pytest.approx(
            report["calibration"]["temperatures"], abs=1e-4
        )
        assert list(cfg.confidence_shifts or ()) == pytest.approx(
            report["calibration"].get("shifts", []), abs=1e-4
        )
        held = report["calibration"]["heldout"]
        assert held["expected_accepted_per_step"] == pytest.approx(
            held["observed_accepted_per_step"], rel=0.05
        )
    elif method == "eagle3":
        assert (cfg.mla is not None) == (name == "deepseek")  # the target's attention kind
        assert cfg.draft_vocab_size < cfg.vocab_size and len(set(cfg.capture)) == 3
        assert {"fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d"} <= keys
        assert all(k.startswith("layers.0.") for k in keys if k.count(".") > 1)
        assert list(cfg.aux_layer_ids) == report["draft"]["layer_ids"]
    else:
        with open(os.path.join(draft, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        assert raw["architectures"] == ["DFlashDraftModel"] and "lm_head.weight" not in keys
        assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= keys
        assert list(cfg.capture) == report["draft"]["layer_ids"] == raw["dflash_config"]["target_layer_ids"]
        assert cfg.block_size == report["draft"]["block_size"]


def test_greedy_speculation_is_lossless_and_every_acceptance_length_occurs(shipped):
    """K = 3 as eval.json measured it (greedy, 64 new tokens, the target's held-out prompts): the
    acceptance length recorded at training, through the public API on the shipped weights, and
    plain decoding's tokens; other K (DFlash: a smaller block chosen at run time too) on the first
    six prompts. Every call admits all its prompts at once: one prefill program per call (a
    prefill compiles per admitted-row count, prompt bucket and K), where admissions as slots free
    compiled four or five; continuous batching is the engine tests' subject, not the drafts'."""
    _, method, model, report, prompts, _, plain = shipped
    out = model.generate(
        prompts, max_new_tokens=64, draft=method, num_speculative_tokens=3, max_batch=len(prompts)
    )
    assert out.tokens == plain
    assert out.stats["acceptance_length"] == pytest.approx(report["acceptance"]["3"], rel=0.02)
    cases = [*CASES[shipped[:2]], (3, 4)] if method == "dflash" else CASES[shipped[:2]]
    for k, block in [(3, None), *cases]:
        spec = out
        if (k, block) != (3, None):
            spec = model.generate(
                prompts[:6],
                max_new_tokens=32,
                max_batch=6,
                draft=method,
                num_speculative_tokens=k,
                **({"draft_block_size": block} if block else {}),
            )
            assert spec.tokens == [t[:32] for t in plain[:6]], (k, block)
        if k > 5:  # a whole block: the acceptance of the last rows is too rare to pin
            continue
        # rates strictly decreasing inside (0, 1): some step accepted exactly j drafts, for each j
        rates = spec.stats["acceptance_rate_per_position"]
        assert rates[-1] > 0.0 and rates[0] < 1.0, (k, rates)
        assert all(a > b for a, b in zip(rates, rates[1:], strict=False)), (k, rates)
