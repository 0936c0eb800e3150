"""scripts/random_dspark.py: a random DSpark draft in DeepSpec's layout that loads beside its target
and speculates with it."""

from __future__ import annotations

import os
import sys

import mtp_jax
from tests.conftest import REPO
from tests.scripts.test_train_tiny import import_script

TARGET = os.path.join(REPO, "tests", "fixtures", "parity_llama", "llama3_gqa42")


def test_writes_a_draft_the_target_loads(tmp_path, monkeypatch, capsys):
    script = import_script(os.path.join(REPO, "scripts", "random_dspark.py"))
    out = tmp_path / "dspark"
    argv = ["random_dspark.py", "--target", TARGET, "--out", str(out), "--block-size", "4", "--rank", "8"]
    monkeypatch.setattr(sys, "argv", [*argv, "--head", "rnn"])
    assert script.main() == 0
    assert "random DSpark draft (2 layers, block 4, rnn rank 8)" in capsys.readouterr().out
    model = mtp_jax.load(TARGET, "float32", strict=True, draft_model=str(out))
    cfg = model.draft_config
    assert (cfg.block_size, cfg.markov_rank, cfg.markov_head_type, cfg.capture) == (4, 8, "rnn", (1,))
    kw = dict(max_new_tokens=6, ignore_eos=True)
    assert (
        model.generate([[5, 9, 17, 3]], **kw, draft="dspark").tokens
        == model.generate([[5, 9, 17, 3]], **kw).tokens
    )
