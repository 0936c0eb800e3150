"""``mtp-jax bench-acceptance`` (:mod:`mtp_jax.acceptance`): the subset, the accepted-length and
per-position arithmetic, the papers' table, a small run end to end, and the server mode against a
stand-in server on loopback."""

from __future__ import annotations

import http.server
import json
import os
import threading

import pytest

from mtp_jax import acceptance
from mtp_jax.cli import main
from tests.conftest import REPO

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
EAGLE3 = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib-eagle3")


def test_subset_is_fixed_by_its_seed():
    prompts = [["p"]] * 100
    a = acceptance.subset(prompts, 10, seed=3)
    assert a == acceptance.subset(prompts, 10, seed=3) and len(set(a)) == 10 and a == sorted(a)
    assert a != acceptance.subset(prompts, 10, seed=4)
    assert acceptance.subset(prompts, 0, 3) == list(range(100)) == acceptance.subset(prompts, 500, 3)


def test_accepted_length_counts_steps_and_the_bonus_token():
    # request 1: 4 steps emitting 3, 1, 2, 4 tokens (K = 3); request 2: 2 steps emitting 1, 2
    stats = [
        {"steps": 4, "acceptance_length": 10 / 4, "num_accepted_tokens_per_pos": [3, 2, 1]},
        {"steps": 2, "acceptance_length": 3 / 2, "num_accepted_tokens_per_pos": [1, 0, 0]},
    ]
    got = acceptance.accepted(stats)
    assert got["steps"] == 6 and got["accepted_length"] == pytest.approx(13 / 6)
    assert got["acceptance_per_position"] == pytest.approx([4 / 6, 2 / 6, 1 / 6])
    # conditional: position 1 among all steps, position j among the steps that accepted j - 1
    assert got["conditional_acceptance_per_position"] == pytest.approx([4 / 6, 2 / 4, 1 / 2])


def test_markdown_has_the_papers_layout():
    rows = [
        {
            "set": s,
            "draft": d,
            "temperature": 0.0,
            "accepted_length": t,
            "speedup_b1": u,
            "conditional_acceptance_per_position": [0.5, 0.25] if d != "plain" else [],
        }
        for s, d, t, u in [
            ("gsm8k", "plain", 1.0, 1.0),
            ("gsm8k", "e3", 3.0, 1.5),
            ("mt-bench", "plain", 1.0, 1.0),
            ("mt-bench", "e3", 2.0, 1.1),
        ]
    ]
    table = acceptance.markdown(rows)
    assert "| draft | GSM8K | MT-Bench | mean |" in table
    assert "| e3 | 3.00 | 2.00 | 2.50 |" in table and "| e3 | 1.50 | 1.10 | 1.30 |" in table
    assert "| e3 | 0.50 | 0.25 |" in table


@pytest.mark.slow
def test_a_small_run_end_to_end(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"turns": [t]}) for t in ["def add(a, b):", "import os\n", "class Stack:"])
    )
    out = tmp_path / "r.json"
    argv = ["bench-acceptance", "--model", LLAMA, "--draft-model", EAGLE3, "--sets", str(prompts)]
    argv += ["--subset", "0", "--k", "2", "--temperature", "0", "1", "--batch", "1", "2"]
    argv += ["--max-new-tokens", "8", "--timing-prompts", "1", "--json", str(out)]
    argv += ["--markdown", str(tmp_path / "r.md")]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["draft"], r["temperature"]) for r in rows] == [
        ("plain", 0.0),
        ("tiny-llama3-stdlib-eagle3 K=2", 0.0),
        ("plain", 1.0),
        ("tiny-llama3-stdlib-eagle3 K=2", 1.0),
    ]
    eagle = rows[1]
    assert eagle["prompts"] == 3 and 1.0 < eagle["accepted_length"] <= 3.0
    assert eagle["steps"] > 0 and len(eagle["conditional_acceptance_per_position"]) == 2
    assert all(r["tokens_per_second_b1"] > 0 and r["speedup_b2"] > 0 for r in rows)
    assert "### Accepted length per step, temperature 0" in (tmp_path / "r.md").read_text()
    # token trees instead of chains, static and dynamic, acceptance only (no --batch: nothing timed)
    argv = ["bench-acceptance", "--model", LLAMA, "--draft-model", EAGLE3, "--sets", str(prompts)]
    argv += ["--subset", "0", "--k", "--tree", "2,2,4", "2,2,4,dynamic", "--temperature", "0", "1"]
    argv += ["--batch", "--max-new-tokens", "8", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["draft"] for r in rows[1:3]] == [
        "tiny-llama3-stdlib-eagle3 tree 2,2,4",
        "tiny-llama3-stdlib-eagle3 tree 2,2,4,dynamic",
    ]
    for r in rows:
        assert not any(key.startswith("tokens_per_second") for key in r)
        if r["draft"] != "plain":
            assert 1.0 < r["accepted_length"] <= 3.0 and len(r["conditional_acceptance_per_position"]) == 2
    with pytest.raises(SystemExit):
        main(["bench-acceptance", "--model", LLAMA, "--draft", "mtp", "--k", "--tree", "2,x"])
    assert "--tree: expected DEPTH,TOPK" in capsys.readouterr().err


class _StandIn(http.server.BaseHTTPRequestHandler):
    """A server with OpenAI's chat route and vLLM's counters: every reply is 10 tokens, made in 4
    steps that accept 6 drafts."""

    counts = {"drafts": 0, "accepted": 0}
    lock = threading.Lock()

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        body = (
            f"vllm:spec_decode_num_drafts_total {self.counts['drafts']}\n"
            f"vllm:spec_decode_num_accepted_tokens_total {self.counts['accepted']}\n"
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 1\n'
        ).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert request["messages"][0]["role"] == "user" and request["max_tokens"] == 32
        with self.lock:
            self.counts["drafts"] += 4
            self.counts["accepted"] += 6
        body = json.dumps({"usage": {"completion_tokens": 10}}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)


def test_server_mode_reads_the_counters(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)  # a port of its own
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("\n".join(json.dumps({"turns": [f"question {i}"]}) for i in range(5)))
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = ["bench-acceptance", "--server", url, "--sets", str(prompts), "--subset", "0"]
        argv += [
            "--temperature",
            "0",
            "--batch",
            "1",
            "3",
            "--max-new-tokens",
            "32",
            "--json",
            str(tmp_path / "s.json"),
        ]
        assert main(argv) == 0
        (row,) = json.loads((tmp_path / "s.json").read_text())["rows"]
        assert row["accepted_length_b1"] == pytest.approx(1 + 6 / 4) == row["accepted_length_b3"]
        assert row["tokens_per_second_b3"] > 0
        assert _StandIn.counts["drafts"] == 4 * (2 + 5)  # 2 timing prompts at batch 1, all 5 at batch 3
    finally:
        server.shutdown()
