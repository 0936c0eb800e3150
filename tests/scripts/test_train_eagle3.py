"""scripts/train_eagle3.py: a few steps against the embedded targets, end to end (GQA and MLA drafts),
resumed deterministically; its draft vocabulary and layer choice; its argument checks."""

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
from mtp_jax.train.frozen import load_params
from tests.conftest import EMBEDDED_MODEL, REPO
from tests.scripts.test_train_tiny import finish, import_script

pytestmark = pytest.mark.spawns  # the scripts run as processes

SCRIPT = os.path.join(REPO, "scripts", "train_eagle3.py")
LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
SMOKE = ["--preset", "smoke", "--steps", "4", "--save-every", "2", "--draft-vocab", "700"]


def start(out, target: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, SCRIPT, "--target", target, "--out", str(out), *SMOKE, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_smoke_runs_write_loadable_drafts_and_resume_deterministically(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    running = start(straight, LLAMA, "--acceptance-k", "2")
    first = finish(start(resumed, LLAMA, "--stop-after", "2", "--acceptance-k"))
    assert first.returncode == 0, first.stderr
    assert not resumed.exists() and "rerun the same command to resume" in first.stderr
    second = finish(start(resumed, LLAMA, "--acceptance-k"))  # the second half of the interrupted run
    run = finish(running)
    assert run.returncode == 0, run.stderr
    assert "train [" in run.stderr and "eagle3 agree" in run.stderr and "tok/s" in run.stderr
    assert second.returncode == 0, second.stderr
    assert "resuming from step 2" in second.stderr
    assert (straight / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["resumed", "straight"]  # training state cleaned up

    assert sorted(os.listdir(straight)) == ["README.md", "config.json", "eval.json", "model.safetensors"]
    with open(straight / "config.json") as f:
        raw = json.load(f)
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 700
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # spread: L = 6
    reader = CheckpointReader(str(straight))
    assert all(k.startswith("layers.0.") or "." not in k.removesuffix(".weight") for k in reader.keys())
    assert "embed_tokens.weight" not in reader  # the target's embedding, not stored
    d2t = reader.get("d2t")
    ids = np.arange(700) + d2t
    assert np.all(np.diff(ids) > 0) and reader.get("t2d").sum() == 700 and reader.get("t2d")[ids].all()
    with open(straight / "eval.json") as f:
        report = json.load(f)
    assert set(report["acceptance"]) == {"2"} and report["acceptance"]["2"] >= 1.0
    assert len(report["heldout"]["level_agreement"]) == 3 and 0 < report["heldout"]["coverage"] <= 1
    assert report["training"]["command"].startswith("python scripts/train_eagle3.py --target")
    assert "EAGLE-3 draft for `tiny-llama3-stdlib`" in (straight / "README.md").read_text()

    # it loads strictly beside its target and speculates losslessly
    prompt = [[0, 5, 9, 17, 3, 40]]
    model = mtp_jax.load(LLAMA, "float32", strict=True, draft_model=str(straight))
    assert model.draft_config.draft_vocab_size == 700
    plain = model.generate(prompt, max_new_tokens=8, ignore_eos=True)
    spec = model.generate(prompt, max_new_tokens=8, ignore_eos=True, draft="eagle3", num_speculative_tokens=3)
    assert spec.tokens == plain.tokens


@pytest.mark.slow
def test_corpus_data_trains_on_the_shards_it_started_with(tmp_path):
    """--data corpus: the held-out conversations' first turns are the acceptance prompts; a run
    resumed after the corpus grew reads the shards it started with (the same draft as a straight
    run); a corpus of another target is refused by name."""
    from tests.train.test_corpus import write_fake_corpus

    corpus = tmp_path / "corpus"
    write_fake_corpus(corpus, "tiny-llama3-stdlib", 2048, 24)
    data = ["--data", "corpus", "--corpus", str(corpus), "--corpus-heldout", "0.3", "--acceptance-k", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    shutil.copytree(corpus, tmp_path / "fixed")  # the straight run's corpus does not grow
    fixed = [*data[:2], "--corpus", str(tmp_path / "fixed"), *data[4:]]
    running = start(straight, LLAMA, *fixed, "--target-cache", str(tmp_path / "cache-a"))
    first = finish(
        start(resumed, LLAMA, *data, "--stop-after", "2", "--target-cache", str(tmp_path / "cache-b"))
    )
    assert first.returncode == 0, first.stderr
    assert "data: corpus" in first.stderr and "6 shards" in first.stderr
    write_fake_corpus(corpus, "tiny-llama3-stdlib", 2048, 8, seed=1, first=6)  # the corpus grows
    second = finish(start(resumed, LLAMA, *data, "--target-cache", str(tmp_path / "cache-b")))
    run = finish(running)
    assert run.returncode == 0, run.stderr
    assert second.returncode == 0, second.stderr
    assert "resuming from step 2" in second.stderr and "6 shards" in second.stderr
    assert (straight / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
    with open(straight / "eval.json") as f:
        report = json.load(f)
    d = report["data"]
    assert (
        d["kind"] == "corpus"
        and d["shards"] == 6
        and d["train_conversations"] + d["heldout_conversations"] == 24
    )
    assert set(d["acceptance_sources"]) <= {"chat", "math", "code"} and report["acceptance"]["2"] >= 1.0
    assert len(report["prompts"]) == sum(d["acceptance_sources"].values())
    card = (straight / "README.md").read_text()
    assert "self-distillation corpus" in card and "held out" in card

    other = tmp_path / "other"
    write_fake_corpus(other, "smollm2-135m-instruct", 49152, 8)
    refused = finish(start(tmp_path / "o", LLAMA, "--data", "corpus", "--corpus", str(other)))
    assert refused.returncode != 0 and "holds the text of 'smollm2-135m-instruct'" in refused.stderr
    assert not (tmp_path / "o").exists()


def test_a_deepseek_target_gets_an_mla_draft_of_its_widths(tmp_path):
    """The draft the script builds for the DeepSeek-V3 target: SGLang's MLA layout at the target's
    widths, its head the target's rows of the draft vocabulary, loadable as published."""
    from mtp_jax.config import load_config, parse_config

    script = load_script()
    with open(os.path.join(EMBEDDED_MODEL, "config.json")) as f:
        target_raw = json.load(f)
    cfg = parse_config(target_raw)
    params = load_params(EMBEDDED_MODEL, cfg)
    ids = np.arange(0, cfg.vocab_size, 3, dtype=np.int32)
    raw = script.draft_config(
        target_raw, cfg, "mla", script.spread_layer_ids(cfg.num_hidden_layers), len(ids)
    )
    assert raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and raw["kv_lora_rank"] == cfg.kv_lora_rank
    dcfg, tree = script.init_draft(raw, cfg, params, ids, seed=0)
    assert dcfg.mla is not None and dcfg.capture == (1, 3, 4)  # inputs 2, 4, 5 of 8 layers
    np.testing.assert_array_equal(np.asarray(tree["draft_to_target"]), ids)
    np.testing.assert_array_equal(np.asarray(tree["lm_head"]), np.asarray(params["lm_head"])[:, ids])
    with pytest.raises(SystemExit, match="needs a DeepSeek-V3 target"):  # a Llama target has no MLA
        script.draft_config(target_raw, load_config(os.path.join(LLAMA, "config.json")), "mla", [1, 2, 3], 8)


def load_script():
    return import_script(SCRIPT)


def test_layer_choice_is_the_usual_one_unless_it_repeats():
    script = load_script()
    assert script.spread_layer_ids(32) == [2, 16, 29]  # EAGLE-3's choice for Llama 3.1 8B
    assert script.spread_layer_ids(8) == [2, 4, 5]
    assert script.spread_layer_ids(6) == [1, 3, 5]  # (2, 3, 3) repeats


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer-ids", "0", "3", "6"], "the target has layers 0..5"),
        (["--draft-vocab", "5000"], "must be in [1, 2048]"),
        (["--depth", "0"], "--depth must be at least 1"),
        (["--own-text", "2"], "a fraction in [0, 1]"),
        (["--acceptance-tokens", "0"], "--acceptance-prompts and --acceptance-tokens must be at least 1"),
    ],
)
def test_arguments_are_checked(tmp_path, monkeypatch, capsys, extra, message):
    argv = ["train_eagle3.py", "--target", LLAMA, "--out", str(tmp_path / "out"), *extra]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        load_script().main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_or_a_target_that_is_not_a_trained_checkpoint(tmp_path, monkeypatch, capsys):
    for target, out, message in (
        (LLAMA, tmp_path, "already exists"),
        (str(tmp_path), tmp_path / "o", "is not a checkpoint"),
    ):
        monkeypatch.setattr(sys, "argv", ["train_eagle3.py", "--target", target, "--out", str(out)])
        with pytest.raises(SystemExit) as exit_:
            load_script().main()
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_card_is_rewritten_without_a_target_and_a_run_needs_one(tmp_path, monkeypatch, capsys):
    script = load_script()
    draft = tmp_path / "draft"
    draft.mkdir()
    for name in ("config.json", "eval.json"):
        shutil.copy(os.path.join(f"{LLAMA}-eagle3", name), draft / name)
    monkeypatch.setattr(sys, "argv", ["train_eagle3.py", "--card", str(draft)])
    assert script.main() == 0
    with open(draft / "config.json") as f, open(draft / "eval.json") as g:
        assert (draft / "README.md").read_text() == script.card(json.load(f), json.load(g))
    monkeypatch.setattr(sys, "argv", ["train_eagle3.py", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 2 and "--target is required" in capsys.readouterr().err


def test_a_gemma_target_gets_a_draft_of_its_rope_base_and_norm_factor():
    """Gemma 3's hub config spells its rope bases in ``rope_parameters`` (no top-level
    ``rope_theta``) and stores RMSNorm weights as w for a 1 + w factor: the draft (Llama-style
    attention, a plain RMSNorm) gets the global base and starts its final norm at 1 + w."""
    from mtp_jax.config import parse_config

    script = load_script()
    fixture = os.path.join(REPO, "tests", "fixtures", "parity_gemma3", "pattern6_tied")
    with open(os.path.join(fixture, "config.json")) as f:
        target_raw = json.load(f)
    assert "rope_theta" not in target_raw
    cfg = parse_config(target_raw)
    params = load_params(fixture, cfg)
    ids = np.arange(0, cfg.vocab_size, 2, dtype=np.int32)
    layer_ids = script.spread_layer_ids(cfg.num_hidden_layers)
    raw = script.draft_config(target_raw, cfg, "gqa", layer_ids, len(ids))
    assert raw["rope_theta"] == 1e6 and raw["head_dim"] == 16
    _, tree = script.init_draft(raw, cfg, params, ids, seed=0)
    final = np.asarray(params["final_norm"])
    assert np.abs(final).max() > 0.01  # the fixture's w is not zero: w and 1 + w differ
    np.testing.assert_allclose(np.asarray(tree["norm"]), 1.0 + final, rtol=1e-6)
    np.testing.assert_allclose(  # the head: the tied embedding's rows of the draft vocabulary
        np.asarray(tree["lm_head"]), np.asarray(params["embed"])[ids].T, rtol=1e-6
    )
