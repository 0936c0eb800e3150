"""scripts/profile_wide_prefill.py: both prompt-bucket rules admit and are timed, and the scheduler's
rule is restored afterwards."""

from __future__ import annotations

import importlib.util
import os

import mtp_jax.scheduler.admission as admission
from tests.conftest import REPO


def test_both_rules_are_timed_and_the_rule_is_restored(tmp_path, capsys):
    path = os.path.join(REPO, "scripts", "profile_wide_prefill.py")
    spec = importlib.util.spec_from_file_location("profile_wide_prefill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rule = admission.shortest_prompt_bucket
    assert module.main(["--rows", "1024", "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "at least 16:" in out and "shortest_prompt_bucket:" in out
    assert admission.shortest_prompt_bucket is rule and rule(1024) == 4
