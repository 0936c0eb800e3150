"""scripts/bench_window_cache.py: both window caches timed on a tiny Gemma 3 fixture, their tokens
checked equal by the script, the ring's KV smaller once the context passes it."""

from __future__ import annotations

import json
import os

from tests.conftest import REPO
from tests.scripts.test_train_tiny import import_script


def test_times_both_window_caches_and_reports_their_kv(tmp_path):
    script = import_script(os.path.join(REPO, "scripts", "bench_window_cache.py"))
    model = os.path.join(REPO, "tests", "fixtures", "parity_gemma3", "mixed_softcap_linear_untied")
    out = tmp_path / "w.json"
    argv = ["--model", model, "--context", "120", "--new-tokens", "2", "--repeats", "1", "--page-size", "4"]
    assert script.main([*argv, "--json", str(out)]) == 0
    rows = {r["window_cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"pages", "ring"} and all(r["context"] == 120 for r in rows.values())
    # one global layer of 30 pages and two local ones of 18 (a window of 3 and a chunk of 64) against 3 x 30
    assert rows["ring"]["kv_bytes"] * 90 == rows["pages"]["kv_bytes"] * (30 + 2 * 18)
    assert all(r["prefill_s"] >= 0 and r["decode_ms_per_token"] is not None for r in rows.values())
