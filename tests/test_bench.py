"""``mtp-jax bench``: the measurement harness runs end to end and reports what it measured."""

from __future__ import annotations

import builtins
import json

import numpy as np
import pytest

from mtp_jax.bench import plot
from mtp_jax.cli import main


def test_bench_on_the_embedded_model_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MTP_JAX_MODEL", raising=False)
    out = tmp_path / "bench.json"
    argv = ["bench", "--k", "0", "2", "--batch", "1", "--prompts", "2", "--new-tokens", "6"]
    auto = tmp_path / "auto.json"
    assert main([*argv, "--repeats", "1", "--json", str(out), "--auto-k-table", str(auto)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| batch | draft | K | acceptance length")
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-deepseek-v3-stdlib"
    assert "held-out prompts (eval.json)" in report["prompts"]
    plain, spec = report["results"]
    assert (plain["draft"], plain["k"], spec["draft"], spec["k"]) == (None, 0, "mtp", 2)
    assert plain["acceptance_length"] == 1.0 and plain["speedup_vs_plain"] == 1.0
    assert 1.0 <= spec["acceptance_length"] <= 3.0 and len(spec["acceptance_by_position"]) == 2
    assert spec["decode_tok_s"] > 0 and spec["fused_over_host"] > 0  # the baseline ran too
    # the auto-K table holds the faster of the two, and a run with it reports the K it chose
    best = 2 if spec["decode_tok_s"] > plain["decode_tok_s"] else 0
    assert json.loads(auto.read_text())["k_by_batch"] == {"mtp": {"1": best}}
    assert main([*argv, "--repeats", "1", "--no-baseline", "--auto-k", str(auto), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["draft"], r["k"], r.get("auto_k")) for r in rows] == [
        (None, 0, None),
        ("mtp", 2, None),
        ("mtp", best, True),
    ]
    assert "| 1 | mtp (auto K) |" in capsys.readouterr().out


def test_bench_on_a_model_without_a_draft_times_plain_decoding(tmp_path, capsys):
    import os

    from tests.conftest import REPO

    model = os.path.join(REPO, "tests", "fixtures", "parity_llama", "llama3_gqa42")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", model, "--batch", "2", "--prompts", "2", "--new-tokens", "4"]
    assert main([*argv, "--repeats", "1", "--json", str(out)]) == 0  # default K: 0 alone
    report = json.loads(out.read_text())
    assert [r["k"] for r in report["results"]] == [0] and "random prompts" in report["prompts"]
    capsys.readouterr()
    assert main([*argv, "--k", "0", "2"]) == 2
    assert "has no draft to speculate with: only --k 0" in capsys.readouterr().err
    # a weightless draft drafts for any model, when named
    ngram = ["--draft", "ngram", "--k", "0", "2", "--repeats", "1", "--no-baseline", "--json", str(out)]
    assert main([*argv, *ngram]) == 0
    assert [(r["draft"], r["k"]) for r in json.loads(out.read_text())["results"]] == [(None, 0), ("ngram", 2)]
    capsys.readouterr()
    # with EAGLE-3 and DFlash drafts beside it, the draft method (and DFlash's block) is an axis
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts.dflash.config import DFlashConfig
    from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
    from mtp_jax.drafts.eagle3.config import Eagle3Config
    from mtp_jax.drafts.eagle3.synthetic import eagle3_hub_tensors
    from tests.drafts.test_dflash import DRAFT_A as DFLASH
    from tests.drafts.test_eagle3 import DRAFT_A, DRAFT_IDS

    draft, dflash = tmp_path / "eagle3", tmp_path / "dflash"
    write_hub_checkpoint(
        draft, DRAFT_A, eagle3_hub_tensors(Eagle3Config.from_dict(DRAFT_A), draft_ids=DRAFT_IDS)
    )
    write_hub_checkpoint(dflash, DFLASH, dflash_hub_tensors(DFlashConfig.from_dict(DFLASH), 2))
    argv += ["--draft-model", str(draft), str(dflash), "--repeats", "1", "--no-baseline"]
    assert main([*argv, "--k", "0", "1", "--block-size", "2", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    got = [(r["draft"], r["k"], r.get("block_size")) for r in report["results"]]
    assert got == [(None, 0, None), ("eagle3", 1, None), ("dflash", 1, 2), ("dflash", 1, 4)]
    table = capsys.readouterr().out
    assert "| 2 | eagle3 | 1 |" in table and "| 2 | dflash (block 4) | 1 |" in table
    assert main([*argv, "--draft", "mtp"]) == 2
    assert "cannot draft with ['mtp']; it has ['eagle3', 'dflash']" in capsys.readouterr().err
    assert main([*argv, "--draft", "dflash", "--block-size", "8"]) == 2
    assert "trained on blocks of 4" in capsys.readouterr().err


def test_bench_refuses_bad_arguments(capsys):
    assert main(["bench", "--batch", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(RuntimeError, match=r"pip install"):
        plot({"results": []}, "unused.png")


def test_bench_writes_the_speeds_of_the_confidence_scheduled_step(tmp_path, capsys):
    """--sps-table with a DSpark draft: steps/s of the scheduling step at widths 1..K+1 per batch,
    a file generate reads back; with K equal to the block (DSpark's anchor slot drafts too). With
    --schedule each K also runs under the confidence schedule on that table, its chosen widths
    reported."""
    import os

    import mtp_jax
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors
    from mtp_jax.schedule import SpsTable
    from tests.conftest import REPO
    from tests.drafts.test_dspark import DSPARK_A, _target_arrays

    model = os.path.join(REPO, "tests", "fixtures", "parity_llama", "llama3_gqa42")
    embed, head = _target_arrays(mtp_jax.load(model, "float32"))
    draft = tmp_path / "dspark"
    write_hub_checkpoint(draft, DSPARK_A, dspark_hub_tensors(DSparkConfig.from_dict(DSPARK_A), embed, head))
    table, out = tmp_path / "sps.json", tmp_path / "bench.json"
    argv = ["bench", "--model", model, "--draft-model", str(draft), "--batch", "1", "2", "--prompts", "2"]
    argv += ["--new-tokens", "4", "--repeats", "1", "--no-baseline", "--k", "4", "--sps-table", str(table)]
    assert main([*argv, "--json", str(out), "--schedule"]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["draft"], r["k"], r.get("schedule")) for r in rows] == [
        (b, "dspark", 4, s) for b in (1, 2) for s in (None, "confidence")
    ]
    printed = capsys.readouterr()
    assert "confidence schedule" in printed.out and "SPS: batch 2, width 5" in printed.err
    sps = SpsTable.load(table)
    assert sps.k == 4 and sorted(sps.tables) == [1, 2] and all(len(r) == 5 for r in sps.tables.values())
    assert sps.meta["draft"] == "dspark"
    for r in rows[1::2]:  # where the measured table says no width pays, the row decoded plainly
        lengths = np.asarray(r["steps_per_verified_drafts"])
        pays = sps.speculation_can_pay(r["batch"], 4)
        assert r["scheduled_plain"] is (not pays) and len(lengths) == (5 if pays else 1) and lengths.sum() > 0
    assert ("plain (no width pays)" in printed.out) is any(r["scheduled_plain"] for r in rows[1::2])
    # a later run schedules on that table without measuring it again
    again = tmp_path / "again.json"
    argv = [a for a in argv if a not in ("--sps-table", str(table))] + ["--batch", "2"]
    assert main([*argv, "--json", str(again), "--schedule", "--sps-from", str(table)]) == 0
    assert "SPS: batch" not in capsys.readouterr().err
    assert [r.get("schedule") for r in json.loads(again.read_text())["results"]] == [None, "confidence"]
    # on a table without plain decoding's speed (no opinion on it), every row-step's verified length
    # is counted and its expected acceptance reported
    no_plain = tmp_path / "no-plain.json"
    no_plain.write_text(json.dumps({k: v for k, v in json.loads(table.read_text()).items() if k != "plain"}))
    assert main([*argv, "--json", str(again), "--schedule", "--sps-from", str(no_plain)]) == 0
    scheduled = json.loads(again.read_text())["results"][1]
    lengths = np.asarray(scheduled["steps_per_verified_drafts"])
    assert not scheduled["scheduled_plain"] and len(lengths) == 5 and lengths[1:].sum() > 0
    assert scheduled["expected_accepted_tokens"] > 0
    # where plain decoding outruns every width even with every draft accepted, it decodes plainly
    fast_plain = tmp_path / "fast-plain.json"
    fast_plain.write_text(json.dumps({**json.loads(table.read_text()), "plain": {"1": 1e9, "2": 1e9}}))
    assert main([*argv, "--json", str(again), "--schedule", "--sps-from", str(fast_plain)]) == 0
    scheduled = json.loads(again.read_text())["results"][1]
    assert scheduled["scheduled_plain"] and scheduled["steps_per_verified_drafts"][0] > 0
    assert len(scheduled["steps_per_verified_drafts"]) == 1 and scheduled["num_accepted_tokens"] == 0
    assert "confidence schedule: plain (no width pays)" in capsys.readouterr().out
    assert main([*argv, "--schedule", "--sps-from", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "--sps-from" in err and "no such file" in err
    assert main(["bench", "--model", model, "--k", "0", "--sps-table", str(table)]) == 2
    assert "needs a draft with a confidence head" in capsys.readouterr().err


def test_prompt_sets_give_first_turns_the_sets_in_turn():
    """--prompt-sets: the first turns of the named sets, the sets taken in turn, --prompts in all
    (rendered as the model reads them), the same on every run; too few is refused by name."""
    import argparse

    import mtp_jax
    from mtp_jax.acceptance import first_turns
    from mtp_jax.bench import held_out_prompts
    from tests.conftest import EMBEDDED_MODEL

    model = mtp_jax.load(EMBEDDED_MODEL, "float32")
    args = argparse.Namespace(prompts=5, prompt_len=8, prompt_sets=["mt-bench", "gsm8k"])
    ids, note = held_out_prompts(model, EMBEDDED_MODEL, args)
    chat, math = first_turns("mt-bench", 3, 0)[1], first_turns("gsm8k", 3, 0)[1]
    assert ids == [model.text.encode(t) for t in (chat[0], math[0], chat[1], math[1], chat[2])]
    assert note == "5 first turns of mt-bench, gsm8k"
    with pytest.raises(SystemExit, match="fewer than --prompts"):
        held_out_prompts(
            model, None, argparse.Namespace(prompts=10**6, prompt_len=8, prompt_sets=["mt-bench"])
        )
