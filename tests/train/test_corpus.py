"""The self-distillation corpus pipeline (mtp_jax.train): the ShareGPT reader on a file cut off
mid-record, decontamination at exactly 13 tokens / 50 characters, the mix, and a tiny regeneration
run killed after its first shard and resumed (from its shards and its staged conversations), which
must write the same shards as one uninterrupted run."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from mtp_jax.train import (
    Decontaminator,
    Plan,
    Prompt,
    Settings,
    build_plan,
    code_prompts,
    finished_shards,
    generate_corpus,
    iter_conversations,
    mix,
    parse_sharegpt,
    read_shard,
    sampling_for,
)
from mtp_jax.train.corpus import follow_plan, window_hashes
from tests.conftest import REPO

TINY = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")


# --- (a) ShareGPT ---------------------------------------------------------------------------


def test_sharegpt_keeps_whole_records_and_drops_the_truncated_tail(tmp_path):
    records = [
        {
            "id": "a_0",
            "conversations": [
                {"from": "human", "value": "  first question  "},
                {"from": "gpt", "value": "an answer"},
                {"from": "human", "value": "second question"},
                {"from": "gpt", "value": "another"},
            ],
        },
        {
            "id": "b_0",  # starts with the assistant, has a system turn and an empty user turn
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "gpt", "value": "hello"},
                {"from": "human", "value": "   "},
                {"from": "user", "value": "only question"},
                {"from": "chatgpt", "value": "reply"},
            ],
        },
        {"id": "c_0", "conversations": [{"from": "gpt", "value": "nobody asked"}]},
        {"id": "a_0", "conversations": [{"from": "human", "value": "a duplicate id"}]},
    ]
    text = json.dumps(records, indent=2)
    tail = ',\n  {\n    "id": "d_0",\n    "conversations": [\n      {"from": "human", "value": "cut o'
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex("]")].rstrip() + tail, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))  # what the packaged file does too

    prompts, stats = parse_sharegpt(str(path))
    assert [p.id for p in prompts] == ["chat:a_0", "chat:b_0"]
    assert prompts[0].turns == ("first question", "second question")
    assert prompts[1].turns == ("only question",)
    assert {p.source for p in prompts} == {"chat"}
    assert stats["records_whole"] == 4
    assert stats["dropped_without_user_turns"] == 1 and stats["dropped_duplicate_ids"] == 1
    assert stats["truncated_tail_chars"] == len(tail) - len(",\n  ")  # from the record's "{" on
    assert stats["turns_by_role"]["system"] == 1 and stats["user_turns"] == 3


# --- (b) decontamination --------------------------------------------------------------------


def _word_encoder():
    """A word-level tokenizer (one token per whitespace-separated word), so that spans are counted
    exactly; the pipeline passes the target's tokenizer instead."""
    vocabulary: dict[str, int] = {}

    def encode(texts: list[str]) -> list[list[int]]:
        return [[vocabulary.setdefault(w, len(vocabulary)) for w in t.split()] for t in texts]

    return encode


def test_window_hashes_match_a_direct_count():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 5, n) for n in (0, 3, 4, 9, 1, 7)]
    hashes, owner = window_hashes(seqs, 4)
    direct = [(i, tuple(s[j : j + 4])) for i, s in enumerate(seqs) for j in range(len(s) - 3)]
    assert owner.tolist() == [i for i, _ in direct]
    by_window: dict[tuple, set[int]] = {}
    for h, (_, w) in zip(hashes.tolist(), direct, strict=True):
        by_window.setdefault(w, set()).add(h)
    assert all(len(v) == 1 for v in by_window.values())  # equal windows, equal hashes
    assert len({next(iter(v)) for v in by_window.values()}) == len(by_window)  # and distinct ones differ


def test_decontamination_13_tokens_removed_12_kept():
    words = [f"w{i}" for i in range(30)]  # 2-3 characters each: 13 words stay under 50 characters
    eval_sets = {"toy": [[" ".join(words[:20])], ["an unrelated second prompt", "and its second turn"]]}
    d = Decontaminator(eval_sets, _word_encoder())
    shared13 = Prompt("chat:x", "chat", ("hello there", "x y " + " ".join(words[3:16]) + " z"))
    shared12 = Prompt("chat:y", "chat", ("x y " + " ".join(words[3:15]) + " z",))
    assert len(" ".join(words[3:16])) < 50
    second_turn = Prompt("math:z", "math", ("q and its second turn",))  # 4 words, 19 characters: kept
    chars = Prompt("code:c", "code", ("Write " + "abcdefghij" * 5 + "!",))  # one long word
    d2 = Decontaminator({"toy": [["a prompt that says " + "abcdefghij" * 5]]}, _word_encoder())
    kept, removed = d.filter([shared13, shared12, second_turn])
    assert [p.id for p in kept] == ["chat:y", "math:z"]
    assert removed == {"chat": 1}
    # 50 characters of whitespace-normalised text, whatever the tokens
    spaced = Prompt("code:d", "code", ("Write:" + "abcdefghij" * 4 + "abcdefghi",))  # 49 shared
    kept, removed = d2.filter([chars, spaced])
    assert [p.id for p in kept] == ["code:d"] and removed == {"code": 1}


def test_build_plan_reports_counts_and_mixes_in_proportion():
    encode = _word_encoder()
    d = Decontaminator(
        {"toy": [["one two three four five six seven eight nine ten eleven twelve thirteen"]]}, encode
    )
    chat = [Prompt(f"chat:{i}", "chat", (f"chat prompt {i}",)) for i in range(40)]
    chat.append(
        Prompt(
            "chat:bad", "chat", ("one two three four five six seven eight nine ten eleven twelve thirteen",)
        )
    )
    math = [Prompt(f"math:{i}", "math", (f"math prompt {i}",)) for i in range(20)]
    code, _ = code_prompts([f"code prompt {i}" for i in range(5)] + ["code prompt 0"])
    long = Prompt("chat:long", "chat", ("word " * 50,))
    plan = build_plan(
        {"chat": chat + [long], "math": math, "code": code}, d, seed=3, max_first_turn_tokens=40
    )
    rec = plan.record["sources"]
    assert rec["chat"]["decontaminated_removed"] == 1 and rec["chat"]["first_turn_over_cap"] == 1
    assert rec["chat"]["in_mix"] == 40 and rec["math"]["in_mix"] == 20 and rec["code"]["in_mix"] == 5
    sources = [p.source for p in plan.prompts]
    assert sources[:8] == ["chat", "math", "code", "chat"] * 2  # 50 / 25 / 25 in every prefix
    assert sources[:20].count("code") == 5 and sources[20:].count("code") == 0  # then code ran out
    again = build_plan(
        {"chat": chat + [long], "math": math, "code": code}, d, seed=3, max_first_turn_tokens=40
    )
    assert again.digest == plan.digest
    assert mix({"chat": chat, "math": math}, {"chat": 0.5, "math": 0.5}, seed=4) != mix(
        {"chat": chat, "math": math}, {"chat": 0.5, "math": 0.5}, seed=5
    )


def test_a_changed_source_follows_the_stored_plan():
    old = [Prompt(f"chat:{i}", "chat", (f"q{i}",)) for i in range(4)]
    new = [Prompt("chat:9", "chat", ("q9",)), old[3], old[0], Prompt("chat:2", "chat", ("q2 changed",))]
    stored = Plan(old, {"old": True})
    followed, missing = follow_plan(Plan(new, {}), stored.ids, stored.digest, stored.record)
    assert followed.digest == stored.digest and followed.record == {"old": True}
    assert followed.ids == ["chat:0", None, "chat:2", "chat:3"] and missing == 1
    assert followed.prompts[2].turns == ("q2 changed",)


# --- (d) evaluation sets ----------------------------------------------------------------------


# --- (c) regeneration: atomic shards, resumable -----------------------------------------------


def _tiny_plan() -> Plan:
    prompts = [
        Prompt("chat:0", "chat", ("def add(a, b):", "class Stack:", "import os")),
        Prompt("code:1", "code", ("def parse(text):",)),
        Prompt("math:2", "math", ("x = 1 + 2",)),
        Prompt("chat:3", "chat", ("for i in range(10):", "while True:")),
        Prompt("code:4", "code", ("# a comment\n" * 17, "more", "and more")),  # the cap ends it
        Prompt("math:5", "math", ("y = x * 3",)),
        Prompt("chat:6", "chat", ("try:", "except ValueError:")),
    ]
    return Plan(prompts, {"test": True})


def _shard_arrays(directory: str) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".npz"):
            with np.load(os.path.join(directory, name)) as z:
                out[name] = {k: z[k] for k in z.files}
    return out


@pytest.mark.slow
def test_regeneration_killed_and_resumed_equals_one_run(tmp_path, monkeypatch):
    import mtp_jax
    from mtp_jax.train import regenerate

    write_staging = regenerate._write_staging
    model = mtp_jax.load(TINY, "float32")
    assert model.text.chat_template is None  # plain completions
    plan = _tiny_plan()
    settings = Settings(max_new_tokens=10, context_cap=96, min_reply_tokens=4, seed=7)
    kwargs = {"target": "tiny", "slots": 2, "shard_size": 3, "log": None, "stage_every": 0}

    whole = str(tmp_path / "whole")
    result = generate_corpus(model, plan, whole, settings, **kwargs)
    assert result["shards_done"] == 3 and result["conversations_done"] == 7
    assert sorted(os.listdir(whole)) == [
        "CARD.md",
        "manifest.json",
        "plan-ids.json.gz",
        "progress.json",
        "shard-00000.npz",
        "shard-00001.npz",
        "shard-00002.npz",
        "staging.json.gz",
    ]

    killed = str(tmp_path / "killed")

    class Killed(Exception):
        pass

    def kill(record):
        assert not [n for n in os.listdir(killed) if ".tmp" in n]  # renamed whole, nothing half there
        raise Killed

    with pytest.raises(Killed):
        generate_corpus(model, plan, killed, settings, on_shard=kill, **kwargs)
    assert len(finished_shards(killed)) == 1
    with gzip.open(tmp_path / "killed" / "staging.json.gz", "rt") as f:
        staged = json.load(f)  # the work past the shard: resumed from, not redone
    assert staged["finished"] or any(row["turn"] >= 1 for row in staged["running"])
    (tmp_path / "killed" / "shard-00002.npz.tmp999").write_bytes(b"half a shard")  # a killed writer's
    generate_corpus(model, plan, killed, settings, **kwargs)
    assert not [n for n in os.listdir(killed) if ".tmp" in n]
    a, b = _shard_arrays(whole), _shard_arrays(killed)
    assert a.keys() == b.keys()
    for name in a:
        for key in a[name]:
            np.testing.assert_array_equal(a[name][key], b[name][key], err_msg=f"{name}: {key}")
    progress = json.loads((tmp_path / "killed" / "progress.json").read_text())
    assert len(progress["runs"]) == 2 and progress["reply_tokens"] == result["reply_tokens"]

    # killed before any shard: its row in the card still says what it did (written with each stage)
    early = str(tmp_path / "early-kill")
    stages = []

    def stage_then_die(*args, **kw):
        stages.append(1)
        if len(stages) == 2:
            raise Killed
        write_staging(*args, **kw)

    monkeypatch.setattr(regenerate, "_write_staging", stage_then_die)
    with pytest.raises(Killed):
        generate_corpus(model, plan, early, settings, **kwargs)
    progress = json.loads(Path(early, "progress.json").read_text())
    assert progress["shards_done"] == 0
    # the killed run's work is on record (its seconds, rounded to 0.1 s, may be 0.0 on a fast machine)
    assert progress["runs"][-1]["engine_reply_tokens"] > 0 and progress["runs"][-1]["seconds"] >= 0

    conversations = list(iter_conversations(whole))
    assert [c.index for c in conversations] == list(range(7))
    first = conversations[0]
    head = model.text.encode("def add(a, b):")
    assert first.tokens[: len(head)].tolist() == head and not first.reply_mask[: len(head)].any()
    assert first.reply_mask[len(head)]  # the reply follows the prompt
    assert len(first.finish) >= 1 and first.reply_tokens == int(first.reply_mask.sum())
    assert all(len(c.tokens) <= settings.context_cap for c in conversations)
    assert {c.end for c in conversations} <= {"done", "cap"} and conversations[4].end == "cap"
    assert {c.source for c in read_shard(os.path.join(whole, "shard-00000.npz"))} == {"chat", "code", "math"}
    card = (tmp_path / "whole" / "CARD.md").read_text()
    assert "reply tokens/s" in card and "No chat template" in card

    # sources that changed since (another package version): the stored plan's order is followed
    changed = Plan([Prompt("math:new", "math", ("z = 4",)), *reversed(plan.prompts[1:])], {})
    again = generate_corpus(model, changed, whole, settings, **kwargs)
    assert again["runs"][-1]["note"] == "nothing to do" and again["reply_tokens"] == result["reply_tokens"]

    # other settings are refused; a token target stops after the shards already started
    with pytest.raises(ValueError, match="settings"):
        generate_corpus(model, plan, whole, Settings(max_new_tokens=11, context_cap=96), **kwargs)
    early = str(tmp_path / "early")
    result = generate_corpus(model, plan, early, settings, target_tokens=1, **kwargs)
    assert 1 <= result["shards_done"] < 3
    assert _shard_arrays(early).keys() <= a.keys()


def test_a_missing_source_package_or_its_dependency_is_named(tmp_path, monkeypatch):
    """An uninstalled source names its package; one installed without its dependencies (pip
    --no-deps) names the missing dependency instead of claiming the package itself is absent."""
    from mtp_jax.train.corpus import require

    with pytest.raises(ImportError, match="needs the 'no-such-source' package: pip install no-such-source"):
        require("no_such_source_module", "no-such-source")
    (tmp_path / "half_installed_source.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="its dependency 'no_such_dependency_here' is not"):
        require("half_installed_source", "half-installed-source")


def test_the_progress_line_says_the_eta_is_unknown_before_any_token():
    import io

    from mtp_jax.train.regenerate import _progress_line

    current = {
        "conversations_done": 640,
        "conversations_planned": 27712,
        "shards_done": 40,
        "shards_planned": 1732,
        "reply_tokens": 389_718,
        "target_tokens": 5_000_000,
    }
    log = io.StringIO()
    _progress_line(log, current, 0, 0, 0, 12.0, 24, 16)  # resumed: nothing generated yet
    assert log.getvalue().rstrip().endswith("0.0 tok/s at 16 slots (24 live), ETA unknown")
    log = io.StringIO()
    _progress_line(log, current, 0, 300, 0, 10.0, 16, 16)  # 30 tok/s: 4,610,282 left
    assert log.getvalue().rstrip().endswith("30.0 tok/s at 16 slots (16 live), ETA 42h41m")


# --- (e) the split the training scripts read (--data corpus) -----------------------------------


def write_fake_corpus(directory, target: str, vocab: int, conversations: int, seed: int = 0, first: int = 0):
    """Shards of random conversations in the corpus layout (prompt, then a reply) with a manifest:
    what ``--data corpus`` reads, without a regeneration run. ``first``: the first shard's number."""
    from mtp_jax.train.shards import Conversation, write_json, write_shard

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    write_json(
        os.path.join(directory, "manifest.json"), {"identity": {"target": target, "vocab_size": vocab}}
    )
    sources = ("chat", "math", "code")
    convs = []
    for i in range(first * 4, first * 4 + conversations):
        prompt, reply = int(rng.integers(4, 12)), int(rng.integers(20, 60))
        tokens = rng.integers(3, vocab, prompt + reply).astype(np.int32)
        mask = np.arange(prompt + reply) >= prompt
        convs.append(Conversation(f"{sources[i % 3]}:{i}", sources[i % 3], i, tokens, mask, ("eos",), "done"))
    for n in range(0, len(convs), 4):
        write_shard(directory, first + n // 4, n, convs[n : n + 4], plan_digest="fake", vocab_size=vocab)
    return convs


def test_the_corpus_split_is_a_function_of_the_ids_and_pins_its_shards(tmp_path):
    from mtp_jax.train.shards import first_turn, held_out, split_corpus

    convs = write_fake_corpus(tmp_path / "c", "t", 500, 24)
    split = split_corpus(str(tmp_path / "c"), 0.3)
    held = [c for c in convs if held_out(c.id, 0.3)]
    train = [c for c in convs if not held_out(c.id, 0.3)]
    assert 0 < len(held) < len(convs)
    np.testing.assert_array_equal(split.train_stream, np.concatenate([c.tokens for c in train]))
    np.testing.assert_array_equal(split.held_stream, np.concatenate([c.tokens for c in held]))
    assert split.train_starts.tolist() == np.cumsum([0] + [len(c.tokens) for c in train[:-1]]).tolist()
    assert sorted(map(tuple, split.held_prompts)) == sorted(tuple(first_turn(c).tolist()) for c in held)
    # the sources in turn: no source twice in a row while another still has prompts
    assert split.held_sources[: len(set(split.held_sources))] == sorted(set(split.held_sources))
    assert split.counts["heldout"] and sum(r["conversations"] for r in split.counts["train"].values()) == len(
        train
    )
    # the first turn is the prompt exactly (up to the first reply token)
    c = convs[0]
    assert (
        first_turn(c).tolist() == c.tokens[: int(np.argmax(c.reply_mask))].tolist()
        and len(first_turn(c)) >= 4
    )
    # a grown corpus: the pinned shards read the same; the whole one keeps every earlier id's side
    write_fake_corpus(tmp_path / "c", "t", 500, 8, seed=1, first=6)
    again = split_corpus(str(tmp_path / "c"), 0.3, split.shards)
    np.testing.assert_array_equal(again.train_stream, split.train_stream)
    grown = split_corpus(str(tmp_path / "c"), 0.3)
    assert len(grown.shards) == 8 and len(grown.train_stream) > len(split.train_stream)
    np.testing.assert_array_equal(grown.held_stream[: len(split.held_stream)], split.held_stream)
    with pytest.raises(FileNotFoundError, match="lacks 1 shard"):
        split_corpus(str(tmp_path / "c"), 0.3, ["shard-00099.npz"])
    with pytest.raises(ValueError, match="both sides need at least one"):
        split_corpus(str(tmp_path / "c"), 1e-9)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        split_corpus(str(tmp_path / "c"), 1.0)


def test_sampling_follows_the_models_own_recommendation_and_the_card_says_where_from():
    """A packaged model samples as its documentation says (Gemma 3: top-k 64, top-p 0.95 at
    temperature 1), a value from the command line over it is named as such, and the committed
    SmolLM2 corpus's card is what ``card`` writes from its manifest (begun before the manifest
    named the source)."""
    from mtp_jax.train.regenerate import card

    chosen, source = sampling_for("gemma-3-270m", {})
    assert chosen == {"temperature": 1.0, "top_p": 0.95, "top_k": 64, "min_p": 0.0}
    assert "generation_config.json" in source
    assert sampling_for("gemma-3-270m", {"top_k": 64})[1] == source  # the same value: still its own
    chosen, source = sampling_for("gemma-3-270m", {"temperature": 0.7})
    assert chosen["temperature"] == 0.7 and chosen["top_k"] == 64 and source == "set on the command line"
    assert sampling_for("some/dir", {})[0] == {} and "no recommendation" in sampling_for("some/dir", {})[1]
    assert sampling_for("some/dir", {"top_p": 0.9})[1] != "set on the command line"  # the default
    with pytest.raises(ValueError, match="not a sampling setting"):
        sampling_for("gemma-3-270m", {"temprature": 1.0})
    corpus = os.path.join(REPO, "training", "corpus-smollm2-135m-instruct")
    manifest = json.loads(Path(corpus, "manifest.json").read_text())
    progress = json.loads(Path(corpus, "progress.json").read_text())
    written = Path(corpus, "CARD.md").read_text()
    assert card({k: v for k, v in manifest.items() if k != "sampling_source"}, progress) == written
    assert "model card example: `temperature=0.2, top_p=0.9" in written
    gemma = card({**manifest, "sampling_source": source}, progress)
    assert "(set on the command line), at most" in gemma
