"""scripts/train_tiny.py: a few steps on a slice of the standard library, end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mtp_jax
from tests.conftest import EMBEDDED_MODEL, REPO

pytestmark = pytest.mark.spawns  # the scripts run as processes

SCRIPT = os.path.join(REPO, "scripts", "train_tiny.py")
SMOKE = ["--preset", "smoke", "--max-files", "12", "--vocab", "300", "--batch", "2", "--seq", "32"]
SMOKE += ["--steps", "4", "--save-every", "2", "--eval-windows", "4", "--acceptance-k", "2"]


def start(out, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SCRIPT, "--out", str(out), *SMOKE, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def train(out, *extra: str) -> subprocess.CompletedProcess:
    return finish(start(out, *extra))


@pytest.mark.slow
def test_smoke_run_writes_a_loadable_hub_checkpoint_and_resumes_deterministically(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # the uninterrupted run and the first half of the interrupted one run side by side (2 cores)
    running = start(straight)
    first = train(resumed, "--stop-after", "2", "--acceptance-k")  # no K: skip the generation part
    run = finish(running)
    assert run.returncode == 0, run.stderr
    assert "train [" in run.stderr and "tok/s" in run.stderr  # the progress line

    names = sorted(os.listdir(straight))
    assert names == [
        "README.md",
        "config.json",
        "eval.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    with open(straight / "config.json") as f:
        config = json.load(f)
    assert config["num_nextn_predict_layers"] == 1 and config["vocab_size"] == 300
    with open(straight / "eval.json") as f:
        report = json.load(f)
    assert np.isfinite(report["heldout"]["loss"]) and report["snippet"]["perplexity"] > 1
    assert set(report["acceptance"]) == {"2"} and report["prompts"]
    model = mtp_jax.load(straight, "float32", strict=True)  # every tensor accounted for, MTP included
    assert "mtp" in model.params
    # The recorded snippet perplexity is reproduced by the public API on the shipped weights.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(straight / "tokenizer.json"))
    ids = tok.encode(report["snippet"]["text"]).ids
    assert model.score(ids).perplexity == pytest.approx(report["snippet"]["perplexity"], rel=1e-3)

    # Interrupted after 2 steps, then resumed: the same weights as the uninterrupted run. Beside
    # the resumed half, the draft fine-tune of the finished model (chained MTP levels, main frozen).
    assert first.returncode == 0, first.stderr
    assert not resumed.exists() and "rerun the same command to resume" in first.stderr
    tuned = tmp_path / "tuned"
    draft_only = ["--init-from", str(straight), "--train", "mtp", "--mtp-depth", "2", "--steps", "2"]
    draft_only += ["--own-text", "0.5", "--own-text-windows", "2"]  # one window per batch of 2
    tuning = start(tuned, *draft_only, "--mtp-labels", "target", "--seed", "1", "--acceptance-k")
    second = train(resumed, "--acceptance-k")
    assert second.returncode == 0, second.stderr
    tune = finish(tuning)
    assert tune.returncode == 0, tune.stderr
    assert "training the MTP layer (MTP depth 2)" in tune.stderr
    check_draft_fine_tune(straight, tuned)
    assert "resuming from step 2" in second.stderr
    for name in ("model.safetensors", "tokenizer.json"):
        assert (straight / name).read_bytes() == (resumed / name).read_bytes(), name
    assert not (tmp_path / "resumed.train").exists()  # the training state is cleaned up
    assert sorted(os.listdir(tmp_path)) == ["resumed", "straight", "tuned"]  # the continuations too


def test_refuses_to_overwrite(tmp_path):
    run = train(tmp_path)
    assert run.returncode == 2 and "already exists" in run.stderr


def check_draft_fine_tune(base, tuned) -> None:
    """--train mtp changes the MTP layer only: every main-model tensor is the base's, bit for bit."""
    from mtp_jax.checkpoint.safetensors_io import CheckpointReader

    with open(base / "config.json") as f:
        mtp_prefix = f"model.layers.{json.load(f)['num_hidden_layers']}."
    before, after = CheckpointReader(str(base)), CheckpointReader(str(tuned))
    assert sorted(before.keys()) == sorted(after.keys())
    changed = {n for n in before.keys() if not np.array_equal(before.get(n), after.get(n))}
    assert changed and all(n.startswith(mtp_prefix) for n in changed), sorted(changed)[:5]
    assert (base / "tokenizer.json").read_bytes() == (tuned / "tokenizer.json").read_bytes()
    with open(tuned / "eval.json") as f:
        report = json.load(f)
    assert report["training"]["trained"] == "mtp" and report["training"]["mtp_depth"] == 2
    assert report["training"]["mtp_labels"] == "target"
    assert report["training"]["own_text"] == 0.5 and report["training"]["own_text_windows"] == 2
    assert report["base"]["training"]["steps"] == 4  # the run it started from
    assert len(report["heldout"]["level_agreement"]) == 3
    card = (tuned / "README.md").read_text()
    assert "Two runs" in card and "chained" in card and "self-distillation" in card
    assert "own greedy continuations" in card


def import_script(path: str):
    """A script of scripts/ as a fresh module (the scripts import each other from their folder)."""
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def load_script():
    return import_script(SCRIPT)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--own-text", "0.5"], "--own-text needs --train mtp"),
        (["--train", "mtp", "--init-from", "EMBEDDED", "--own-text", "1.5"], "a fraction in [0, 1]"),
        (["--train", "mtp", "--init-from", "EMBEDDED", "--own-text", "0.01"], "is not one window"),
        (["--train", "mtp", "--init-from", "EMBEDDED", "--own-text-windows", "0"], "at least 1"),
    ],
)
def test_own_text_arguments_are_checked(tmp_path, monkeypatch, capsys, extra, message):
    argv = [a.replace("EMBEDDED", EMBEDDED_MODEL) for a in extra]
    monkeypatch.setattr(sys, "argv", ["train_tiny.py", "--out", str(tmp_path / "out"), *argv])
    with pytest.raises(SystemExit) as exit_:
        load_script().main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_llama_smoke_run_reuses_the_tokenizer_and_writes_a_llama_checkpoint(tmp_path):
    """--arch llama: the same data and the given model's tokenizer, next-token loss only, a Llama
    hub checkpoint that loads strictly, generates, and reproduces its recorded perplexity."""
    out = tmp_path / "llama"
    run = train(out, "--arch", "llama", "--tokenizer-from", EMBEDDED_MODEL, "--acceptance-k")
    assert run.returncode == 0, run.stderr
    assert "model: llama" in run.stderr and "(next-token loss)" in run.stderr and "mtp " not in run.stderr
    with open(out / "config.json") as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["rope_scaling"]["rope_type"] == "llama3"
    shared = (out / "tokenizer.json").read_bytes()
    with open(os.path.join(EMBEDDED_MODEL, "tokenizer.json"), "rb") as f:
        assert shared == f.read()
    with open(out / "eval.json") as f:
        report = json.load(f)
    assert "acceptance" not in report and "mtp_weight" not in report["training"]
    assert report["training"]["tokenizer_from"] == os.path.basename(EMBEDDED_MODEL)
    model = mtp_jax.load(out, "float32", strict=True)
    assert model.drafts == () and "layers" in model.params
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode(report["snippet"]["text"]).ids
    assert model.score(ids).perplexity == pytest.approx(report["snippet"]["perplexity"], rel=1e-3)
    assert len(model.generate([ids[:8]], max_new_tokens=4, ignore_eos=True).tokens[0]) == 4
    card = (out / "README.md").read_text()
    assert "Tiny Llama 3" in card and "llama3 scaling" in card


def test_llama_refuses_draft_options(tmp_path, monkeypatch, capsys):
    argv = ["train_tiny.py", "--out", str(tmp_path / "out"), "--arch", "llama", "--mtp-depth", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        load_script().main()
    assert exit_.value.code == 2 and "--arch llama trains the whole model" in capsys.readouterr().err
