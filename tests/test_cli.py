"""The ``mtp-jax`` command line: in-process through ``mtp_jax.cli.main`` (fast: compiled functions are
shared with the API calls), plus one subprocess run of the installed console script."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mtp_jax
from mtp_jax.cli import _tree_arg, main
from tests.conftest import EMBEDDED_MODEL, require_extra

FIB = "def fibonacci(n):"
CODE = "import os\nprint(os.getcwd())"
MAIN = 'if __name__ == "__main__":\n    main()\n'
STATS = re.compile(
    r"\[steps (\d+), (\d+) new tokens in [\d.]+s .*; decode [\d.]+ tok/s after the first step "
    r"\([\d.]+s, compiling it\); acceptance length ([\d.]+)"
    r"(?:; acceptance by position \[([\d., ]+)\])?"
    r"; time to first token (\d+) ms(?:, ([\d.]+) ms per token after it \(means over requests\))?\]"
)
ROW = re.compile(r"\[(\d+) tokens, stopped by (eos|length|grammar)\]")


@pytest.fixture(scope="module")
def embedded():
    """The embedded model as the CLI loads it (float32), and its tokenizer."""
    from tokenizers import Tokenizer

    model = mtp_jax.load(EMBEDDED_MODEL, dtype="float32")
    return model, Tokenizer.from_file(os.path.join(EMBEDDED_MODEL, "tokenizer.json"))


@pytest.fixture(autouse=True)
def _no_model_env(monkeypatch):
    monkeypatch.delenv("MTP_JAX_MODEL", raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def expected_text(embedded, prompts: list[str], **kwargs) -> list[str]:
    """What the CLI should print for each prompt: prompt + decoded new tokens (bos prepended)."""
    model, tok = embedded
    ids = [tok.encode(p).ids for p in prompts]
    result = model.generate(ids, **kwargs)
    return [
        p + tok.decode(new, skip_special_tokens=True) for p, new in zip(prompts, result.tokens, strict=True)
    ]


def check_stats(err: str, max_new: int, prompts: int = 1, k: int = 3) -> None:
    """The stats line: plain decoding (k = 0) accepts one token per step; with k drafts the
    acceptance length lies in [1, k + 1] and k per-position rates are printed."""
    m = STATS.search(err)
    assert m, err
    steps, new = int(m.group(1)), int(m.group(2))
    assert 1 <= steps <= max_new
    assert (m.group(6) is not None) == (new > prompts)  # a time per token where a request decoded
    rows = ROW.findall(err)
    assert len(rows) == prompts, err
    assert new == sum(int(n) for n, _ in rows)
    for n, reason in rows:
        assert 1 <= int(n) <= max_new
        if reason == "length":
            assert int(n) == max_new
    if k == 0:
        assert float(m.group(3)) == 1.0 and m.group(4) is None
    else:
        assert 1.0 <= float(m.group(3)) <= k + 1
        rates = [float(x) for x in m.group(4).split(",")]
        assert len(rates) == k and all(0 <= r <= 1 for r in rates)


def test_generate_embedded_default(capsys, embedded):
    """The README's command: the trained default speculates with its MTP layer (K = 3) and prints
    exactly what plain greedy decoding would."""
    rc, out, err = run(capsys, "generate", "--prompt", FIB, "--max-new-tokens", "8")
    assert rc == 0, err
    assert out.startswith(FIB)
    assert out == expected_text(embedded, [FIB], max_new_tokens=8)[0] + "\n"
    assert "steps" in err and "tok/s" in err and "acceptance length" in err
    check_stats(err, 8, k=3)
    assert "Traceback" not in err


def test_generate_draft_choices(capsys, embedded, tmp_path):
    base = ["generate", "--prompt", FIB, "--max-new-tokens", "8"]
    want = expected_text(embedded, [FIB], max_new_tokens=8)[0] + "\n"
    rc, out, err = run(capsys, *base, "--draft", "none")
    assert rc == 0 and out == want, err
    check_stats(err, 8, k=0)
    rc, out, err = run(capsys, *base, "-k", "2")
    assert rc == 0 and out == want, err
    check_stats(err, 8, k=2)
    rc, _, err = run(capsys, *base, "--draft", "none", "-k", "2")
    assert rc == 2 and "-k needs a draft" in err
    # an auto-K table caps -k; relaxed acceptance never acts outside a thinking phase
    from mtp_jax import autok

    table = os.path.join(tmp_path, "auto.json")
    autok.write(table, {"mtp": {1: 1, 8: 0}}, {})
    rc, out, err = run(capsys, *base, "--auto-k", table, "--relaxed-topk", "3", "--think-tokens", "5", "6")
    assert rc == 0 and out == want, err
    check_stats(err, 8, k=1)
    # a token tree: plain decoding's text, acceptance by depth (3 of them)
    rc, out, err = run(capsys, *base, "--speculative-tree", "3,2,6")
    assert rc == 0 and out == want, err
    check_stats(err, 8, k=3)
    with pytest.raises(SystemExit) as exit_:  # argparse's own refusal
        run(capsys, *base, "--speculative-tree", "3,two")
    assert exit_.value.code == 2 and "DEPTH,TOPK" in capsys.readouterr().err
    assert _tree_arg("3,2,6,dynamic") == {"depth": 3, "topk": 2, "nodes": 6, "dynamic": True}
    assert _tree_arg("3, 2") == {"depth": 3, "topk": 2}


def test_generate_sampling_flags_reproducible(capsys, embedded):
    args = ["generate", "--model", EMBEDDED_MODEL, "--prompt", FIB, "--max-new-tokens", "8"]
    sampling = ["--temperature", "0.8", "--top-k", "5", "--seed", "3", "--ignore-eos"]
    rc1, out1, err1 = run(capsys, *args, *sampling)
    rc2, out2, _ = run(capsys, *args, *sampling)
    assert rc1 == rc2 == 0, err1
    assert out1 == out2
    # The flags reach model.generate: the same text as the API with the same parameters.
    want = expected_text(embedded, [FIB], max_new_tokens=8, temperature=0.8, top_k=5, seed=3, ignore_eos=True)
    assert out1 == want[0] + "\n"
    assert "[8 tokens, stopped by length]" in err1
    greedy = expected_text(embedded, [FIB], max_new_tokens=8, ignore_eos=True)[0]
    assert out1 != greedy + "\n"


def test_generate_stops_at_eos_unless_ignore_eos(capsys, embedded):
    # The end of a script, where the model often ends the document: find a seed that samples EOS
    # within 8 tokens through the API, then check that the CLI stops there too (and not with
    # --ignore-eos).
    model, tok = embedded
    ids = tok.encode(MAIN).ids
    seed = next(
        s
        for s in range(64)
        if model.generate([ids], max_new_tokens=8, temperature=1.0, seed=s).finish_reasons == ["eos"]
    )
    api = model.generate([ids], max_new_tokens=8, temperature=1.0, seed=seed)
    assert api.tokens[0][-1] in model.eos_token_ids
    n = len(api.tokens[0])
    args = ["generate", "--prompt", MAIN, "--max-new-tokens", "8", "--temperature", "1", "--seed", str(seed)]
    rc, out, err = run(capsys, *args)
    assert rc == 0, err
    assert f"[{n} tokens, stopped by eos]" in err
    assert out == expected_text(embedded, [MAIN], max_new_tokens=8, temperature=1.0, seed=seed)[0] + "\n"
    rc, out, err = run(capsys, *args, "--ignore-eos")
    assert rc == 0, err
    assert "[8 tokens, stopped by length]" in err
    want = expected_text(embedded, [MAIN], max_new_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
    assert out == want[0] + "\n"


def test_generate_batch_of_two_prompts(capsys, embedded):
    prompts = [FIB, "class Stack:"]
    rc, out, err = run(
        capsys, "generate", "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "8"
    )
    assert rc == 0, err
    sections = out.split("=" * 60 + "\n")
    assert sections[0] == ""
    want = expected_text(embedded, prompts, max_new_tokens=8)
    assert sections[1:] == [w + "\n" for w in want]
    check_stats(err, 8, prompts=2)


def test_score_matches_model_score(capsys, embedded):
    model, tok = embedded
    rc, out, err = run(capsys, "score", "--text", CODE)
    assert rc == 0, err
    ids = tok.encode(CODE).ids
    assert len(ids) > 10

    lines = out.splitlines()
    assert lines[0].split()[:3] == ["pos", "token", "logprob"]
    rows = [re.match(r"^\s*(\d+)\s+(\d+)\s+(-?\d+\.\d{4})\s+(.*)$", line) for line in lines[1:-1]]
    assert all(rows), lines
    assert [int(r.group(1)) for r in rows] == list(range(1, len(ids)))
    assert [int(r.group(2)) for r in rows] == ids[1:]
    printed = np.array([float(r.group(3)) for r in rows])

    # Independent recomputation from the teacher-forced logits.
    logits = np.asarray(model.logits([ids])[0], np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ref = logits[np.arange(len(ids) - 1), ids[1:]] - logz[:-1]
    np.testing.assert_allclose(model.score(ids).logprobs, ref, atol=1e-4)
    np.testing.assert_allclose(printed, ref, atol=1e-4)

    m = re.fullmatch(
        r"tokens scored: (\d+)  total logprob: (-?[\d.]+)  mean: (-?[\d.]+)  perplexity: ([\d.]+)", lines[-1]
    )
    assert m, lines[-1]
    assert int(m.group(1)) == len(ids) - 1
    perplexity = math.exp(-ref.mean())
    assert float(m.group(4)) == pytest.approx(perplexity, rel=1e-4)
    assert float(m.group(2)) == pytest.approx(ref.sum(), abs=1e-3)
    assert float(m.group(3)) == pytest.approx(ref.mean(), abs=1e-4)
    assert model.score(ids).perplexity == pytest.approx(perplexity, rel=1e-5)


ERRORS = [
    # (argv after the subcommand, words the error line must contain)
    (["generate", "--prompt", "x", "--top-p", "0"], ["top_p"]),
    (["generate", "--prompt", "x", "--temperature", "-1"], ["temperature"]),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], ["max_new_tokens"]),
    (["generate", "--prompt", "x", "--max-new-tokens", "5000"], ["5000", "maximum length 4096"]),
    (["generate", "--prompt", "x", "--min-p", "1"], ["min_p"]),
    (["generate", "--prompt", "x", "--top-k", "-1"], ["top_k"]),
    (["generate", "--prompt", "x", "--seed", "-1"], ["seed"]),
    (["generate", "--prompt", "x", "--relaxed-topk", "2"], ["no <think> and </think>", "think_tokens"]),
    (["generate", "--prompt", "x", "--auto-k", "no-such.json"], ["no-such.json does not exist"]),
    (["generate", "--prompt", "x", "--speculative-tree", "2,2,9"], ["between 2 and 6", "nodes=9"]),
    (["generate", "--prompt", "x", "--speculative-tree", "2,2,7,dynamic"], ["dynamic", "between 2 and 6"]),
    (
        ["generate", "--prompt", "x", "--draft", "ngram", "--speculative-tree", "2,2"],
        ["proposes token trees"],
    ),
    (["generate", "--prompt", "x", "--regex", "("], ["grammar of prompt 0 is invalid"]),
    (["generate", "--prompt", "x", "--json-schema", "no-such.json"], ["--json-schema", "cannot read"]),
    (["generate", "--prompt", "x", "--lark", "no-such.lark"], ["--lark", "cannot read"]),
    (["score", "--text", ""], ["too short"]),
]


@pytest.mark.parametrize(("argv", "words"), ERRORS, ids=[" ".join(a[-2:]) or "empty" for a, _ in ERRORS])
def test_errors_exit_2_with_one_line(capsys, argv, words):
    rc, out, err = run(capsys, argv[0], "--model", EMBEDDED_MODEL, *argv[1:])
    check_error(rc, out, err, argv[0], words)


def check_error(rc: int, out: str, err: str, command: str, words: list[str]) -> None:
    assert rc == 2, (out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, err
    assert errors[0] == lines[-1]
    assert errors[0].startswith(f"mtp-jax {command}: error: ")
    for w in words:
        assert w in errors[0], (w, errors[0])


@pytest.mark.parametrize("command", ["generate", "score"])
def test_error_missing_model_dir(capsys, tmp_path, command):
    missing = str(tmp_path / "no-such-model")
    text = ["--prompt", "x"] if command == "generate" else ["--text", "a b c"]
    rc, out, err = run(capsys, command, "--model", missing, *text)
    check_error(rc, out, err, command, ["not found", missing])


def test_error_model_dir_without_tokenizer(capsys, make_checkpoint):
    path = make_checkpoint()
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))
    rc, out, err = run(capsys, "generate", "--model", path, "--prompt", "x")
    check_error(rc, out, err, "generate", ["tokenizer.json", path])


def test_error_default_model_env_points_nowhere(capsys, monkeypatch, tmp_path):
    missing = str(tmp_path / "gone")
    monkeypatch.setenv("MTP_JAX_MODEL", missing)
    rc, out, err = run(capsys, "score", "--text", "a b")
    check_error(rc, out, err, "score", [missing])


def test_huge_top_k_keeps_every_token(capsys):
    """A top-k beyond the vocabulary keeps every token (it is clamped, not refused): sampled text
    equals the text with top-k off, under the same seed."""
    argv = ["generate", "--model", EMBEDDED_MODEL, "--prompt", "x", "--temperature", "1", "--seed", "3"]
    argv += ["--max-new-tokens", "12", "--draft", "none"]
    rc, huge, err = run(capsys, *argv, "--top-k", str(2**40))
    assert rc == 0, err
    rc, off, err = run(capsys, *argv, "--top-k", "0")
    assert rc == 0, err
    rc, small, err = run(capsys, *argv, "--top-k", "1")  # greedy: the check can tell them apart
    assert rc == 0, err
    assert huge == off and huge.strip()
    assert small != off, "top-k 1 and top-k off gave the same text: the comparison shows nothing"


@pytest.mark.spawns
def test_console_script_subprocess(tmp_path, embedded):
    script = os.path.join(os.path.dirname(sys.executable), "mtp-jax")
    if not os.path.isfile(script):
        script = shutil.which("mtp-jax")
    cmd = [script] if script else [sys.executable, "-m", "mtp_jax.cli"]
    env = {k: v for k, v in os.environ.items() if k != "MTP_JAX_MODEL"}
    proc = subprocess.run(
        [*cmd, "generate", "--prompt", FIB, "--max-new-tokens", "8"],
        cwd=tmp_path,  # the embedded default is found independently of the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(FIB)
    assert proc.stdout == expected_text(embedded, [FIB], max_new_tokens=8)[0] + "\n"
    assert "loading" in proc.stderr and "tok/s" in proc.stderr and "acceptance length" in proc.stderr
    check_stats(proc.stderr, 8)


def test_generate_under_a_grammar(capsys, embedded, tmp_path):
    """--regex and --json-schema FILE: the printed continuation is valid and complete."""
    require_extra("llguidance")
    args = ["generate", "--prompt", FIB, "--max-new-tokens", "40", "--temperature", "1"]
    rc, out, err = run(capsys, *args, "--regex", r"return [a-z]{1,4}\(n\)")
    assert rc == 0, err
    assert re.fullmatch(r"return [a-z]{1,4}\(n\)", out.strip()[len(FIB) :]), out
    assert ROW.search(err).group(2) == "grammar", err
    schema = tmp_path / "schema.json"
    schema.write_text(
        '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],'
        ' "additionalProperties": false}'
    )
    rc, out, err = run(capsys, *args, "--json-schema", str(schema))
    assert rc == 0, err
    obj = json.loads(out.strip()[len(FIB) :])
    assert list(obj) == ["n"] and isinstance(obj["n"], int), out
    schema.write_text("{")
    rc, out, err = run(capsys, *args, "--json-schema", str(schema))
    check_error(rc, out, err, "generate", ["not valid JSON"])


def test_a_packaged_model_is_served_under_the_name_it_was_asked_by(tmp_path):
    """`mtp-jax serve --model gemma-3-270m` answers to "gemma-3-270m" (not to its file's name); a
    directory or file answers to its base name."""
    from mtp_jax.cli import default_served_name

    assert default_served_name("gemma-3-270m", "/c/gemma-3-270m-q4_k_m.gguf") == "gemma-3-270m"
    assert default_served_name("smollm2-135m-instruct", "/x/SmolLM2.gguf") == "smollm2-135m-instruct"
    assert default_served_name(str(tmp_path / "m"), str(tmp_path / "m")) == "m"
    assert default_served_name(None, "/repo/checkpoints/tiny-deepseek-v3-stdlib") == "tiny-deepseek-v3-stdlib"
