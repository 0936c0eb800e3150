"""mtp_jax.train.frozen: a draft's run against a frozen target (end to end in tests/scripts/)."""

from __future__ import annotations

import numpy as np
import pytest

from mtp_jax.train.frozen import draft_vocabulary


def test_draft_vocabulary_is_the_most_frequent_tokens_ascending():
    streams = [np.array([5, 5, 5, 2, 2, 9, 7, 7, 7, 7]), np.array([[9, 9], [1, 1]])]
    # counts: 7 -> 4, 5 -> 3, 9 -> 3, 2 -> 2, 1 -> 2; a tie keeps the lower id
    np.testing.assert_array_equal(draft_vocabulary(streams, 10, 3), [5, 7, 9])
    np.testing.assert_array_equal(draft_vocabulary(streams, 10, 4), [1, 5, 7, 9])
    assert draft_vocabulary(streams, 10, 4).dtype == np.int32


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_a_chat_run_trains_on_the_targets_own_greedy_replies(tmp_path):
    """``--data chat``: the target (a tiny Llama given a chat template) answers the standard-library
    prompts greedily once (replies kept in --replies-dir, read back by the next run, not
    regenerated); the training stream is each rendered prompt followed by its reply, the held-out
    prompts are rendered the same way, and a target without a chat template is refused by name."""
    import argparse
    import json
    import shutil

    import mtp_jax
    from mtp_jax.train.frozen import add_run_arguments, start_run
    from tests.conftest import REPO

    target = tmp_path / "tiny-chat"
    shutil.copytree(f"{REPO}/checkpoints/tiny-llama3-stdlib", target)
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    argv = ["--target", str(target), "--out", str(tmp_path / "draft"), "--data", "chat", "--max-files", "5"]
    argv += [
        "--max-prompts",
        "3",
        "--reply-tokens",
        "6",
        "--eval-prompts",
        "1",
        "--replies-dir",
        str(tmp_path),
    ]
    run = start_run(parser.parse_args(argv), parser)
    assert run.data["kind"] == "chat" and run.data["train_prompts"] == 3
    train_file = tmp_path / "replies-tiny-chat-train-6.jsonl"
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    assert len(rows) == 3 and (tmp_path / "replies-tiny-chat-heldout-6.jsonl").is_file()

    model = mtp_jax.load(str(target), "float32")
    codec = model.text
    expected = []
    for row in rows:  # each reply is the target's own greedy continuation of the rendered prompt
        ids = codec.encode_chat([{"role": "user", "content": row["prompt"]}])
        assert row["reply"] == model.generate([ids], max_new_tokens=6, temperature=0.0).tokens[0]
        expected += ids + row["reply"]
    np.testing.assert_array_equal(run.train_stream, expected)
    np.testing.assert_array_equal(
        run.train_starts, [0, *np.cumsum([len(x) for x in expected_parts(rows, codec)])[:-1]]
    )
    held = run.prompt_ids()
    assert held and held[0] == codec.encode_chat([{"role": "user", "content": run.target_eval["prompts"][0]}])

    train_file.write_text("".join(json.dumps({**r, "reply": r["reply"][:2]}) + "\n" for r in rows))
    again = start_run(parser.parse_args(argv), parser)  # the kept replies are read, not generated again
    assert len(again.train_stream) == len(expected) - sum(len(r["reply"]) - 2 for r in rows)

    few = [("2" if a == "5" else a) for a in argv]  # --max-files 2: no held-out prompt
    with pytest.raises(SystemExit, match="0 held-out prompts from --max-files 2"):
        start_run(parser.parse_args(few), parser)
    (target / "tokenizer_config.json").unlink()
    with pytest.raises(SystemExit, match="has no chat template"):
        start_run(parser.parse_args(argv), parser)


def expected_parts(rows: list[dict], codec) -> list[list[int]]:
    return [codec.encode_chat([{"role": "user", "content": r["prompt"]}]) + r["reply"] for r in rows]


def test_a_corpus_run_draws_its_windows_in_the_sources_weights(tmp_path):
    """``--source-weights chat=0,math=1,code=1`` on a corpus: no window of any step starts in a chat
    conversation (and they do without it), the shares are in the run's data record, and the option
    is refused for data that is not a corpus and for a source the corpus lacks."""
    import argparse

    from mtp_jax.train.frozen import add_run_arguments, start_run
    from mtp_jax.train.shards import split_corpus
    from tests.conftest import REPO
    from tests.train.test_corpus import write_fake_corpus

    corpus = tmp_path / "corpus"
    write_fake_corpus(corpus, "tiny-llama3-stdlib", 2048, 24)
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    argv = [
        "--target",
        f"{REPO}/checkpoints/tiny-llama3-stdlib",
        "--out",
        str(tmp_path / "d"),
        "--data",
        "corpus",
    ]
    argv += ["--corpus", str(corpus), "--corpus-heldout", "0.3", "--batch", "8", "--seq", "16"]

    sources = split_corpus(str(corpus), 0.3).train_sources

    def chat_windows(run) -> int:
        ends = np.append(run.train_starts[1:], len(run.train_stream))
        chat = [(a, b) for a, b, s in zip(run.train_starts, ends, sources, strict=True) if s == "chat"]
        starts = np.concatenate([run.window_offsets(step) for step in range(20)])
        np.testing.assert_array_equal(
            run.batch(3)["window"], [run.train_stream[x : x + 17] for x in run.window_offsets(3)]
        )
        return sum(a <= x < b for x in starts for a, b in chat)

    plain = start_run(parser.parse_args(argv), parser)
    weighed = start_run(parser.parse_args([*argv, "--source-weights", "chat=0,math=1,code=1"]), parser)
    assert chat_windows(plain) > 0 and chat_windows(weighed) == 0
    assert weighed.data["source_weights"] == {"code": 0.5, "math": 0.5}
    with pytest.raises(SystemExit):
        start_run(parser.parse_args([*argv[:5], "stdlib", "--source-weights", "code=1"]), parser)
    with pytest.raises(SystemExit, match="not in the data: \\['poetry'\\]"):
        start_run(parser.parse_args([*argv, "--source-weights", "chat=1,math=1,code=1,poetry=1"]), parser)


def test_a_cards_usage_line_asks_a_base_model_for_a_completion():
    """A draft trained on a base model's corpus (no chat template) is shown with ``--prompt``;
    a chat model's with ``--chat``; a draft of a tiny target trained here with its checkpoint."""
    from mtp_jax.train.cards import usage_line

    chat = {"data": {"kind": "corpus", "chat_template": True}, "target": "t", "name": "d"}
    base = {**chat, "data": {"kind": "corpus", "chat_template": False}, "target_path": "gemma-3-270m"}
    assert "--chat " in usage_line(chat, "eagle3") and "--prompt" not in usage_line(chat, "eagle3")
    line = usage_line(base, "dflash")
    assert "--model gemma-3-270m" in line and '--prompt "def' in line and "--chat" not in line
    tiny = usage_line({"data": {"kind": "stdlib"}, "target": "tiny", "name": "d"}, "eagle3")
    assert "--model checkpoints/tiny" in tiny and "--chat" not in tiny
