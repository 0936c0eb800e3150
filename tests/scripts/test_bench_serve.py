"""scripts/bench_serve.py's prefix-caching workloads: the numbers they report come from the engine's
counters (prompt tokens prefilled, hits), and the replies are the same with and without caching."""

from __future__ import annotations

import json

import pytest

from tests.scripts import run_script

pytestmark = [pytest.mark.spawns, pytest.mark.slow]  # the script runs as a process; engines compile


def _results(tmp_path, *args: str) -> tuple[list[dict], str]:
    out = tmp_path / "bench.json"
    common = ["--slots", "2", "--drafts", "mtp", "--k", "3", "--new-tokens", "16", "--json", str(out)]
    run = run_script("bench_serve.py", *args, *common, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]  # 1: the replies differ with caching
    return json.loads(out.read_text())["results"], run.stdout


def test_multi_turn_later_turns_read_the_replies_from_the_cache(tmp_path):
    rows, stdout = _results(
        tmp_path, "--workload", "multi-turn", "--requests", "2", "--turns", "3", "--system-len", "40"
    )
    off, on = rows
    assert off["prompt_tokens"] == on["prompt_tokens"] == off["prompt_tokens_prefilled"]
    # turns 2 and 3 find the previous prompt and its reply: fewer tokens than prompt pages alone
    alone = on["prompt_tokens_prefilled_prompt_pages_only"]
    assert on["prompt_tokens_prefilled"] < alone < on["prompt_tokens"]
    assert "same replies with and without prefix caching: True" in stdout


def test_a_burst_on_a_new_system_prompt_prefills_it_once(tmp_path):
    rows, stdout = _results(tmp_path, "--workload", "shared-prefix", "--requests", "4", "--system-len", "64")
    off, warm, cold = rows
    assert [r["prefix_caching"] for r in rows] == ["off", "on", "on, cold"]
    prompt = off["prompt_tokens_prefilled"]  # 4 x (64 + 32), nothing cached
    # pages of 16; MTP's entry at a position reads the next token, so the system prompt's fourth page
    # (its next token a question's) is not shared: 3 pages of 16 per request
    assert prompt == 4 * 96 and warm["prompt_tokens_prefilled"] == prompt - 4 * 48
    # the first request prefills the whole system prompt, the three after it read those 3 pages
    assert cold["prompt_tokens_prefilled"] == prompt - 3 * 48
    assert "same tokens with and without prefix caching: True" in stdout
