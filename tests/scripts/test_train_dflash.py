"""scripts/train_dflash.py: a few steps against the embedded Llama target, end to end, resumed
deterministically; its anchors and the draft it builds for each target; its argument checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from tests.conftest import EMBEDDED_MODEL, REPO
from tests.scripts.test_train_tiny import finish, import_script

pytestmark = pytest.mark.spawns  # the scripts run as processes

SCRIPT = os.path.join(REPO, "scripts", "train_dflash.py")
LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
SMOKE = ["--target", LLAMA, "--preset", "smoke", "--steps", "4", "--save-every", "2", "--acceptance-k"]


def start(out, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, SCRIPT, "--out", str(out), *SMOKE, *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_smoke_run_writes_a_loadable_draft_and_goes_on_from_an_exported_one(tmp_path):
    """A straight run, and one interrupted after exporting its draft (--export-every) whose orbax
    state is then lost (another machine): it goes on from OUT.partial at the step reached, with a
    draft vocabulary the partial was not trained with (--draft-vocab: the head is the target's
    either way). (scripts/test_train_eagle3.py checks the byte-exact resume from the orbax state.)"""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    partial = tmp_path / "resumed.partial"
    running = start(straight, "2")
    first = finish(start(resumed, "--stop-after", "2", "--export-every", "2"))
    assert first.returncode == 0, first.stderr
    assert not resumed.exists() and "rerun the same command to resume" in first.stderr
    assert sorted(os.listdir(partial)) == ["config.json", "model.safetensors", "progress.json"]
    assert json.loads((partial / "progress.json").read_text())["step"] == 2
    shutil.rmtree(tmp_path / "resumed.train")  # the orbax state stays behind on the old machine
    second = finish(start(resumed, "--export-every", "2", "--draft-vocab", "64"))
    run = finish(running)
    assert run.returncode == 0, run.stderr
    assert "train [" in run.stderr and "dflash agree" in run.stderr
    assert second.returncode == 0, second.stderr
    assert "starting from the draft at step 2" in second.stderr and "step 4/4" in second.stderr
    assert sorted(os.listdir(tmp_path)) == ["resumed", "straight"]  # training state and partial cleaned up

    with open(straight / "config.json") as f:
        raw = json.load(f)
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    assert raw["dflash_config"] == {
        "mask_token_id": 2,
        "target_layer_ids": [1, 3],
    }  # DFlash's default, 2 layers
    keys = CheckpointReader(str(straight)).keys()
    assert "layers.1.self_attn.k_norm.weight" in keys and not any(
        "embed" in k or "lm_head" in k for k in keys
    )
    with open(straight / "eval.json") as f:
        report = json.load(f)
    assert set(report["acceptance"]) == {"2"} and len(report["heldout"]["level_agreement"]) == 3
    # the smoke preset measures acceptance on 8 prompts x 16 tokens, says so, and so drops the
    # target's own MTP figures (measured on all its prompts x 64 tokens)
    assert report["acceptance_setup"] == {"prompts": 8, "new_tokens": 16} and "mtp_acceptance" not in report
    card = (straight / "README.md").read_text()
    assert "16 new tokens on the first 8 of the target's held-out prompts" in card
    assert report["training"]["command"].startswith("python scripts/train_dflash.py --out")
    assert "DFlash draft for `tiny-llama3-stdlib`" in card
    prompt = [[0, 5, 9, 17, 3, 40]]
    for out in (straight, resumed):
        model = mtp_jax.load(LLAMA, "float32", strict=True, draft_model=str(out))
        plain = model.generate(prompt, max_new_tokens=8, ignore_eos=True)
        assert (
            model.generate(prompt, max_new_tokens=8, ignore_eos=True, draft="dflash").tokens == plain.tokens
        )

    # the resumed run's draft vocabulary: the 64 most frequent training tokens, as d2t offsets
    with open(resumed / "config.json") as f:
        assert json.load(f)["draft_vocab_size"] == 64
    reader = CheckpointReader(str(resumed))
    d2t = np.asarray(reader.get("d2t"))
    ids = np.arange(64) + d2t
    assert d2t.shape == (64,) and np.all(np.diff(ids) > 0) and "lm_head.weight" not in reader.keys()
    assert np.array_equal(np.asarray(model.params["dflash"]["draft_to_target"]), ids)
    with open(resumed / "eval.json") as f:
        report = json.load(f)
    assert report["draft"]["draft_vocab_size"] == 64 and 0 < report["heldout"]["coverage"] <= 1
    assert "64 most frequent" in (resumed / "README.md").read_text()


def load_script():
    return import_script(SCRIPT)


def test_anchors_are_drawn_from_seed_and_step_inside_the_window():
    script = load_script()
    a = script.anchors_for(0, 7, 3, 16, 64, 8)
    assert a.shape == (3, 16) and a.dtype == np.int32 and a.min() >= 0 and a.max() <= 64 - 8
    assert np.array_equal(a, script.anchors_for(0, 7, 3, 16, 64, 8))
    assert not np.array_equal(a, script.anchors_for(0, 8, 3, 16, 64, 8))
    assert np.all(np.diff(a, axis=1) >= 0)


@pytest.mark.parametrize("target", [LLAMA, EMBEDDED_MODEL])
def test_the_draft_it_builds_loads_beside_its_target(target):
    from mtp_jax.config import parse_config

    script = load_script()
    with open(os.path.join(target, "config.json")) as f:
        target_raw = json.load(f)
    cfg = parse_config(target_raw)
    raw = script.draft_config(target_raw, cfg, 2, [1, cfg.num_hidden_layers - 2], 8)
    dcfg, tree = script.init_draft(raw, cfg, seed=0)
    assert "lm_head" not in tree  # the target's whole head, not a copy
    assert dcfg.hidden_size == cfg.hidden_size and dcfg.block_size == 8 and dcfg.mask_token_id == 2
    assert dcfg.capture == (1, cfg.num_hidden_layers - 2)
    np.testing.assert_array_equal(np.asarray(tree["norm"]), 1.0)
    assert tree["layers"]["attn"]["q"].shape[0] == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer-ids", "0", "6"], "the target has layers 0..5"),
        (["--block-size", "1"], "--block-size >= 2"),
        (["--own-text", "2"], "a fraction in [0, 1]"),
        (["--draft-vocab", "0"], "--draft-vocab 0 must be in [1, "),
    ],
)
def test_arguments_are_checked(tmp_path, monkeypatch, capsys, extra, message):
    argv = ["train_dflash.py", "--target", LLAMA, "--out", str(tmp_path / "out"), *extra]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        load_script().main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
