"""The evaluation prompt sets shipped with the package (:mod:`mtp_jax.evalsets`) and the strict
reader every prompt file goes through (the benchmark command, decontamination)."""

from __future__ import annotations

import pytest

from mtp_jax import evalsets


def test_shipped_evaluation_sets():
    assert evalsets.names() == ["gsm8k", "humaneval", "mbpp", "mt-bench"]
    sizes = {name: len(rows) for name, rows in evalsets.read_all().items()}
    assert sizes == {"gsm8k": 1319, "humaneval": 164, "mbpp": 257, "mt-bench": 80}
    assert all(len(t) == 2 for t in evalsets.read("mt-bench"))


def test_evaluation_set_reader_names_file_and_line(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text('{"turns": ["a question"]}\n\n{"turns": ["one", "two"]}\n', encoding="utf-8")
    assert evalsets.read(str(good)) == [["a question"], ["one", "two"]]
    for bad_line in ('{"turns": ["ok"', '{"turns": []}', '{"prompt": "x"}', '["x"]', '{"turns": ["a", 3]}'):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"turns": ["fine"]}\n' + bad_line + "\n", encoding="utf-8")
        with pytest.raises(evalsets.EvalSetError, match=rf"{bad}, line 2"):
            evalsets.read(str(bad))
    with pytest.raises(evalsets.EvalSetError, match="no evaluation set 'nope'"):
        evalsets.read("nope")
