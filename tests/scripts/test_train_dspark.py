"""scripts/train_dspark.py: a smoke run against the embedded Llama target, stopped and resumed from
its exported draft, calibrated and shipped in DeepSpec's layout; its loss against the draft's own
teacher-forced blocks; its calibration report; its argument checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.train.frozen import load_params
from tests.conftest import EMBEDDED_MODEL, REPO
from tests.scripts.test_train_tiny import finish, import_script

SCRIPT = os.path.join(REPO, "scripts", "train_dspark.py")
LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
SMOKE = ["--target", LLAMA, "--preset", "smoke", "--steps", "4", "--save-every", "2", "--acceptance-k", "2"]
SMOKE += ["--calibration-seeds", "2"]  # 16 rollouts of 16 tokens a calibration: a smoke run


def start(out, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, SCRIPT, "--out", str(out), *SMOKE, *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.spawns
def test_smoke_run_resumes_from_its_exported_draft_and_ships_a_calibrated_draft(tmp_path):
    """Stopped after exporting its draft (--export-every) with its orbax state then lost (another
    machine), the run goes on from OUT.partial, calibrates the confidences on held-out rollouts and
    writes a draft in DeepSpec's layout that loads strictly and speculates losslessly."""
    out, partial = tmp_path / "draft", tmp_path / "draft.partial"
    first = finish(start(out, "--stop-after", "2", "--export-every", "2"))
    assert first.returncode == 0, first.stderr
    assert not out.exists() and "rerun the same command to resume" in first.stderr
    assert json.loads((partial / "progress.json").read_text())["step"] == 2
    assert "lm_head.weight" not in CheckpointReader(str(partial)).keys()  # the target's copies: not kept
    shutil.rmtree(tmp_path / "draft.train")
    second = finish(start(out, "--export-every", "2", "--no-frozen-copies"))
    assert second.returncode == 0, second.stderr
    assert "starting from the draft at step 2" in second.stderr and "step 4/4" in second.stderr
    assert "calibration (scaling): temperatures" in second.stderr
    assert sorted(os.listdir(tmp_path)) == ["draft"]  # the training state and the partial cleaned up

    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["block_size"] == 4
    assert raw["markov_rank"] == 8 and raw["markov_head_type"] == "vanilla" and raw["enable_confidence_head"]
    temps, shifts = raw["confidence_temperatures"], raw["confidence_shifts"]
    assert len(temps) == 4 and all(t > 0 for t in temps) and len(shifts) == 4
    keys = set(CheckpointReader(str(out)).keys())
    assert {"markov_head.markov_w1.weight", "confidence_head.proj.weight"} <= keys
    assert not keys & {"lm_head.weight", "embed_tokens.weight"}  # --no-frozen-copies
    report = json.loads((out / "eval.json").read_text())
    c = report["calibration"]
    assert c["fit"]["prompts"] == 4 and c["heldout"]["prompts"] == 4 and c["heldout"]["steps"] > 0
    assert c["method"] == "scaling" and c["heldout_temperature_only"]["steps"] == c["heldout"]["steps"]
    assert len(c["heldout"]["ece_per_slot"]) == 4 and set(report["acceptance"]) == {"2"}
    assert len(report["heldout"]["level_acceptance"]) == 4
    card = (out / "README.md").read_text()
    assert "DSpark draft for `tiny-llama3-stdlib`" in card and "A temperature and a shift per slot" in card
    assert "temperature alone (the paper's)" in card and "left out of this shipped checkpoint" in card

    model = mtp_jax.load(LLAMA, "float32", strict=True, draft_model=str(out))
    assert model.draft_config.confidence_temperatures == tuple(temps)
    assert model.draft_config.confidence_shifts == tuple(shifts)
    prompt = [[0, 5, 9, 17, 3, 40]]
    plain = model.generate(prompt, max_new_tokens=8, ignore_eos=True)
    spec = model.generate(prompt, max_new_tokens=8, ignore_eos=True, draft="dspark", num_speculative_tokens=4)
    assert spec.tokens == plain.tokens

    # --recalibrate: the paper's temperatures instead, fitted on the draft's rollouts without its
    # calibration; the weights and the rest of eval.json untouched
    weights = (out / "model.safetensors").read_bytes()
    argv = [sys.executable, SCRIPT, "--recalibrate", str(out), "--calibration", "temperature"]
    again = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr
    assert "calibration (temperature): temperatures" in again.stderr
    raw = json.loads((out / "config.json").read_text())
    assert "confidence_shifts" not in raw and len(raw["confidence_temperatures"]) == 4
    redone = json.loads((out / "eval.json").read_text())
    assert (
        redone["calibration"]["method"] == "temperature"
        and "heldout_temperature_only" not in redone["calibration"]
    )
    assert (
        redone["calibration"]["heldout_uncalibrated"] == c["heldout_uncalibrated"]
    )  # rollouts of the same draft
    assert {k: v for k, v in redone.items() if k != "calibration"} == {
        **{k: v for k, v in report.items() if k != "calibration"},
        "draft": {**report["draft"], "frozen_copies": False},
    }
    assert (out / "model.safetensors").read_bytes() == weights
    assert "Sequential temperature scaling (the paper's" in (out / "README.md").read_text()
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "eval.json", "model.safetensors"]
    bad = subprocess.run([*argv[:2], "--recalibrate", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode != 0 and "not a draft written by this script" in bad.stderr


@pytest.mark.slow
@pytest.mark.spawns
def test_smoke_run_with_a_draft_vocabulary(tmp_path):
    """--draft-vocab: the most frequent training tokens (as EAGLE-3's and DFlash's), W2 over them,
    the head the target's columns (only d2t / t2d stored); it loads strictly and speculates
    losslessly."""
    out = tmp_path / "draft"
    run = finish(start(out, "--draft-vocab", "700", "--no-frozen-copies"))
    assert run.returncode == 0, run.stderr
    raw = json.loads((out / "config.json").read_text())
    assert raw["draft_vocab_size"] == 700
    reader = CheckpointReader(str(out))
    assert reader.shape("markov_head.markov_w2.weight") == (700, 8) and reader.get("t2d").sum() == 700
    assert "draft vocabulary of the 700 most frequent" in (out / "README.md").read_text()
    model = mtp_jax.load(LLAMA, "float32", strict=True, draft_model=str(out))
    ids = np.asarray(model.params["dspark"]["draft_to_target"])
    assert len(ids) == 700 and np.all(np.diff(ids) > 0)
    prompt = [[0, 5, 9, 17, 3, 40]]
    plain = model.generate(prompt, max_new_tokens=8, ignore_eos=True)
    spec = model.generate(prompt, max_new_tokens=8, ignore_eos=True, draft="dspark", num_speculative_tokens=4)
    assert spec.tokens == plain.tokens


def test_the_loss_over_a_draft_vocabulary_is_the_restricted_one(small_draft):
    """With a draft vocabulary the loss compares the draft's distribution over it with the target's
    renormalised over it; labels outside it drop out of the cross-entropy only."""
    from mtp_jax.drafts.dspark.draft import dspark_features, teacher_forced_block
    from mtp_jax.drafts.dspark.losses import LossWeights, dspark_losses
    from mtp_jax.drafts.dspark.training import FIXED
    from mtp_jax.targets import target_for
    from mtp_jax.targets.base import lm_head

    script, cfg, params, _, _ = small_draft
    with open(os.path.join(LLAMA, "config.json")) as f:
        target_raw = json.load(f)
    raw = script.draft_config(target_raw, cfg, 1, [-1, 1], 4, 2, 8, "vanilla", True, 500)
    ids = np.sort(np.random.default_rng(2).choice(cfg.vocab_size, 500, replace=False)).astype(np.int32)
    dcfg, tree = script.init_draft(raw, cfg, params, seed=1, ids=ids)
    assert set(FIXED) <= set(tree) and tree["markov"]["w2"].shape == (8, 500)
    rng = np.random.default_rng(1)
    outside = int(np.setdiff1d(np.arange(cfg.vocab_size), ids)[0])
    window = jnp.asarray(rng.choice(ids, (2, 25)), jnp.int32).at[0, 7].set(outside)
    anchors = jnp.asarray([[0, 4, 9], [2, 10, 15]], jnp.int32)
    weights = LossWeights(0.3, 0.6, 0.8, 2.0)
    got = script.draft_losses(tree, params, cfg, dcfg, window, anchors, weights)[1]
    # the same from dspark_losses fed the restricted pieces by hand
    inputs = window[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(24), inputs.shape)
    hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions, capture=dcfg.capture)
    full, conf = teacher_forced_block({**params, "dspark": tree}, dcfg, inputs, dspark_features(dcfg, hidden))
    rows = np.asarray(anchors)[..., None] + np.arange(4)
    b = np.arange(2)[:, None]
    labels = np.asarray(window)[b[..., None], rows + 1]
    draft_logits = np.asarray(full)[b, np.asarray(anchors)][..., ids]  # its finite entries
    target = np.asarray(lm_head(params, hidden.post_norm))[b[..., None], rows][..., ids]
    to_draft = np.full(cfg.vocab_size, -1)
    to_draft[ids] = np.arange(500)
    inside = to_draft[labels] >= 0
    assert not inside.all()  # a label outside the vocabulary is among them
    conf = np.asarray(conf)[b, np.asarray(anchors)]
    want = dspark_losses(
        draft_logits,
        target,
        np.maximum(to_draft[labels], 0),
        np.ones(labels.shape, bool),
        conf,
        weights,
        inside,
    )
    for key in ("loss", "ce", "l1", "confidence", "acceptance"):
        np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=2e-5, err_msg=key)
    # not vacuous: counting the outside label's cross-entropy (at draft id 0) changes the loss
    wrong = dspark_losses(
        draft_logits, target, np.maximum(to_draft[labels], 0), np.ones(labels.shape, bool), conf, weights
    )
    assert abs(float(wrong["ce"]) - float(got["ce"])) > 1e-3
    # from a target cache whose kept tokens at one position all lie outside the draft vocabulary
    # (Gemma 3's 262k head against 8,192 kept): nothing there to renormalise; the loss stays finite
    # (it was NaN) and that slot counts as rejected (acceptance 0), its neighbours as before
    logp = jax.nn.log_softmax(lm_head(params, hidden.post_norm), axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp, 4)
    cached = {"features": dspark_features(dcfg, hidden), "top_logp": top_logp}
    whole = script.draft_losses(
        tree, params, cfg, dcfg, window, anchors, weights, {**cached, "top_ids": top_ids}
    )
    blind = top_ids.at[0, int(rows[0, 0, 1])].set(
        jnp.asarray(np.setdiff1d(np.arange(cfg.vocab_size), ids)[:4])
    )
    loss, aux = script.draft_losses(
        tree, params, cfg, dcfg, window, anchors, weights, {**cached, "top_ids": blind}
    )
    assert np.isfinite(float(loss)) and np.isfinite(float(whole[0]))
    assert float(aux["acceptance"]) < float(whole[1]["acceptance"])
    assert float(aux["level_acceptance"][1]) < float(whole[1]["level_acceptance"][1])
    np.testing.assert_allclose(aux["level_acceptance"][2:], whole[1]["level_acceptance"][2:], rtol=1e-6)


def load_script():
    return import_script(SCRIPT)


@pytest.fixture(scope="module")
def small_draft():
    """A random DSpark draft the script builds for the embedded Llama target (its Markov and
    confidence heads drawn larger than at initialisation, so that they matter)."""
    from mtp_jax.config import parse_config

    script = load_script()  # puts scripts/ on the path
    with open(os.path.join(LLAMA, "config.json")) as f:
        target_raw = json.load(f)
    cfg = parse_config(target_raw)
    params = load_params(LLAMA, cfg)
    raw = script.draft_config(target_raw, cfg, 1, [-1, 1], 4, 2, 8, "rnn", True)
    dcfg, tree = script.init_draft(raw, cfg, params, seed=1)
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda x: x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), tree)
    return script, cfg, params, dcfg, tree


def test_the_loss_is_deepspecs_over_the_drafts_own_teacher_forced_blocks(small_draft):
    """The training loss at sampled anchors equals :func:`dspark_losses` over the draft's own
    teacher-forced blocks (every anchor of the sequence at once, the draft's implementation checked
    against the paper's equations in tests/drafts/test_dspark.py) gathered at those anchors, against
    the target's next-token distributions: slot k of the block at anchor a reads token a + k and
    predicts token a + 1 + k."""
    from mtp_jax.drafts.dspark.draft import dspark_features, teacher_forced_block
    from mtp_jax.drafts.dspark.losses import LossWeights, dspark_losses
    from mtp_jax.targets import target_for
    from mtp_jax.targets.base import lm_head

    script, cfg, params, dcfg, tree = small_draft
    rng = np.random.default_rng(1)
    window = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 25)), jnp.int32)
    anchors = jnp.asarray(np.sort(rng.integers(0, 24 - 4 + 1, (2, 5)), axis=1), jnp.int32)
    weights = LossWeights(0.3, 0.6, 0.8, 2.0)
    fn = jax.jit(lambda t, w, a: script.draft_losses(t, params, cfg, dcfg, w, a, weights)[1])
    got = fn(tree, window, anchors)

    inputs = window[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(24), inputs.shape)
    hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions, capture=dcfg.capture)
    logits, conf = teacher_forced_block(
        {**params, "dspark": tree}, dcfg, inputs, dspark_features(dcfg, hidden)
    )
    target = lm_head(params, hidden.post_norm)  # [b, T, V]
    rows = np.asarray(anchors)[..., None] + np.arange(4)  # [b, n, B]
    b = np.arange(2)[:, None]
    labels = np.asarray(window)[b[..., None], rows + 1]
    want = dspark_losses(
        np.asarray(logits)[b, np.asarray(anchors)],
        np.asarray(target)[b[..., None], rows],
        labels,
        np.ones(labels.shape, bool),
        np.asarray(conf)[b, np.asarray(anchors)],
        weights,
    )
    for key in ("loss", "ce", "l1", "confidence", "acceptance"):
        np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=2e-5, err_msg=key)
    assert float(got["confidence"]) > 0 and len(got["level_acceptance"]) == 4
    # not vacuous: one position off (the block at a reading the target's row a - 1) is far away
    shifted = dspark_losses(
        np.asarray(logits)[b, np.asarray(anchors)],
        np.asarray(target)[b[..., None], np.maximum(rows - 1, 0)],
        labels,
        np.ones(labels.shape, bool),
        np.asarray(conf)[b, np.asarray(anchors)],
        weights,
    )
    assert abs(float(shifted["l1"]) - float(got["l1"])) > 1e-2


def test_the_calibration_report_measures_expected_against_observed():
    """Expected accepted drafts per step = the sum over verified drafts of the running products of
    sigmoid(z / T); a temperature that makes every confidence 1 expects every verified draft."""
    script = load_script()
    logits = np.array([[0.0, 0.0], [2.0, -1.0], [50.0, 50.0]])
    verified, accepted = np.array([2, 1, 2]), np.array([1, 0, 2])
    r = script.calibration_report(logits, verified, accepted, None)
    s = 1 / (1 + np.exp(-logits))
    want = (s[0, 0] + s[0, 0] * s[0, 1] + s[1, 0] + s[2, 0] + s[2, 0] * s[2, 1]) / 3
    assert r["steps"] == 3 and r["expected_accepted_per_step"] == pytest.approx(want, abs=1e-4)
    assert r["observed_accepted_per_step"] == pytest.approx(1.0)
    cooler = script.calibration_report(logits, verified, accepted, (0.5, 2.0))
    assert cooler["expected_accepted_per_step"] != r["expected_accepted_per_step"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer-ids", "0", "5"], "the target's layers run -1 (the embedding) .. 4"),
        (["--block-size", "1"], "--block-size >= 2"),
        (["--markov-rank", "-1"], "--markov-rank must be >= 0"),
        (["--seq", "4", "--block-size", "4"], "--seq 4 is not longer than a block of 4"),
    ],
)
def test_arguments_are_checked(tmp_path, monkeypatch, capsys, extra, message):
    argv = ["train_dspark.py", "--target", LLAMA, "--out", str(tmp_path / "out"), *extra]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        load_script().main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_draft_it_builds_for_a_deepseek_target_loads():
    from mtp_jax.config import parse_config

    script = load_script()
    with open(os.path.join(EMBEDDED_MODEL, "config.json")) as f:
        target_raw = json.load(f)
    cfg = parse_config(target_raw)
    raw = script.draft_config(target_raw, cfg, 2, [0, 6], 7, 2, 16, "gated", True)
    params = load_params(EMBEDDED_MODEL, cfg)
    dcfg, tree = script.init_draft(raw, cfg, params, seed=0)
    assert raw["model_type"] == "qwen3" and dcfg.capture == (0, 6) and dcfg.block_size == 7
    assert tree["markov"]["w1"].shape == (cfg.vocab_size, 16) and "gate" in tree["markov"]
    np.testing.assert_array_equal(np.asarray(tree["norm"]), 1.0)


def test_a_trained_draft_restricted_to_a_draft_vocabulary_drafts_its_conditional(tmp_path, monkeypatch):
    """scripts/restrict_dspark_vocab.py: a full-vocabulary DSpark with W2's rows of the most frequent
    tokens and d2t added; its teacher-forced logits are the full draft's on those ids, -inf elsewhere
    (its distribution: the full one conditioned on the vocabulary); bad input refused by name."""
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors
    from mtp_jax.train.frozen import draft_vocabulary
    from tests.drafts.test_dspark import DSPARK_A, TARGET, _target_arrays, _teacher_forced

    target = mtp_jax.load(TARGET, "float32")
    embed, head = _target_arrays(target)
    full = tmp_path / "full"
    write_hub_checkpoint(
        full, DSPARK_A, dspark_hub_tensors(DSparkConfig.from_dict(DSPARK_A), embed, head, seed=3)
    )
    replies = tmp_path / "replies.jsonl"
    rng = np.random.default_rng(0)
    replies.write_text(
        "".join(
            json.dumps({"prompt": "p", "reply": rng.zipf(1.3, 40).clip(0, 127).tolist()}) + "\n"
            for _ in range(30)
        )
    )
    script = import_script(os.path.join(REPO, "scripts", "restrict_dspark_vocab.py"))
    out = tmp_path / "restricted"
    argv = ["restrict_dspark_vocab.py", "--draft", str(full), "--tokens", str(replies), "--vocab", "50"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    assert script.main() == 0
    ids = draft_vocabulary([script.token_stream(str(replies))], 128, 50)
    a = mtp_jax.load(TARGET, "float32", strict=True, draft_model=str(full))
    b = mtp_jax.load(TARGET, "float32", strict=True, draft_model=str(out))
    np.testing.assert_array_equal(np.asarray(b.params["dspark"]["draft_to_target"]), ids)
    tokens = np.asarray([[5, 9, 17, 3, 40, 2, 2, 7]])
    got, want = np.asarray(_teacher_forced(b, tokens)[0]), np.asarray(_teacher_forced(a, tokens)[0])
    # blocks inside the sequence (every slot's previous token given): the same logits on the vocabulary
    whole = tokens.shape[1] - DSPARK_A["block_size"] + 1
    np.testing.assert_allclose(got[:, :whole][..., ids], want[:, :whole][..., ids], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.delete(got, ids, axis=-1)).all()
    for extra, message in (
        (["--draft", str(out)], "already has a draft vocabulary"),
        (["--vocab", "500"], r"must be in \[1, 128\]"),
        (["--draft", str(tmp_path)], "config.json"),
    ):
        monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path / "x"), *extra])
        with pytest.raises((SystemExit, FileNotFoundError), match=message):
            script.main()
    assert not (tmp_path / "x").exists()
