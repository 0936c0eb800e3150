"""A draft defined outside the package (here, in this file) and registered with
``register_draft`` runs everywhere a shipped one does: ``generate``, the engine, the CLI,
``mtp-jax bench``, ``mtp-jax plan`` and the roofline, with no edit to the package."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest

import mtp_jax
from mtp_jax.cli import main
from mtp_jax.drafts import DRAFTS, Draft, register_draft, unregister_draft
from mtp_jax.drafts.base import at_rows
from mtp_jax.roofline import step_bytes
from tests.conftest import REPO

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")


def _echo(params, sc, state, page_table, rows, active, sampling, first_pos):
    """Propose the newest committed token K times (right whenever the text repeats a token)."""
    newest = at_rows(rows.next_tokens, rows.last)
    drafts = jnp.broadcast_to(newest[:, None], (newest.shape[0], sc.k)).astype(jnp.int32)
    q = jax.nn.one_hot(drafts, sc.cfg.vocab_size) if sc.sampled else jnp.zeros((newest.shape[0], sc.k, 0))
    return drafts, q, state


def _echo_teacher_forced(params, sc, tokens, hidden):
    onehot = jax.nn.one_hot(tokens[:, 1:], sc.cfg.vocab_size)
    return jnp.where(onehot > 0, 0.0, -jnp.inf)


ECHO = Draft(
    name="echo",
    available=lambda params, cfg: None,
    capture=lambda sc: (),
    init_state=lambda sc, num_pages, dtype: jnp.zeros((), jnp.int32),
    state_logical=lambda names, rank: (None,) * rank,
    extend_and_propose=_echo,
    teacher_forced=_echo_teacher_forced,
)


@pytest.fixture
def echo():
    register_draft(ECHO)
    yield ECHO
    unregister_draft("echo")


PROMPTS = [[8, 8, 8, 8, 8], [5, 9, 17, 3], [40, 2, 2, 7]]


def test_a_registered_draft_runs_everywhere_a_shipped_one_does(echo, tmp_path, capsys):
    model = mtp_jax.load(LLAMA, "float32", page_size=4)
    assert "echo" in model.drafts  # it has no weights to miss: available to every model
    plain = model.generate(PROMPTS, max_new_tokens=10, ignore_eos=True).tokens
    spec = model.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, draft="echo", num_speculative_tokens=2)
    assert spec.tokens == plain and spec.stats["num_draft_tokens"] > 0
    assert model.draft_logits([PROMPTS[1]], draft="echo").argmax(-1).tolist() == [PROMPTS[1][1:]]
    with mtp_jax.Engine(model, slots=2, max_len=32, draft="echo", num_speculative_tokens=2) as engine:
        handles = [engine.submit(p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS]
        assert [list(h.result(timeout=120).tokens) for h in handles] == plain
    argv = ["--model", LLAMA, "--draft", "echo", "-k", "2", "--max-new-tokens", "6"]
    assert main(["generate", *argv, "--prompt", "def f(x):"]) == 0
    out = tmp_path / "bench.json"
    bench = ["bench", "--model", LLAMA, "--draft", "echo", "--k", "0", "2", "--batch", "1", "--prompts", "1"]
    assert main([*bench, "--new-tokens", "4", "--repeats", "1", "--no-baseline", "--json", str(out)]) == 0
    assert [r["draft"] for r in json.loads(out.read_text())["results"]] == [None, "echo"]
    capsys.readouterr()
    # plan compiles the step with it (abstract shapes, one device)
    planned = ["--draft", "echo", "-k", "2", "--mesh", "data=1", "--batch", "2", "--max-len", "32"]
    assert main(["plan", LLAMA, *planned]) == 0
    assert "echo K=2" in capsys.readouterr().out
    # the roofline asks the draft what it reads (no step_reads hook: nothing of its own)
    got = step_bytes(model.params, model.config, k=2, batch=1, context=4, cache_itemsize=4, draft="echo")
    assert got.draft_weights == got.draft_heads == got.draft_experts == 0 and got.target_weights > 0


def test_registration_is_checked(echo):
    assert DRAFTS["echo"] is ECHO and register_draft(ECHO) is ECHO  # the same draft again: a no-op
    other = Draft(**{**ECHO.__dict__, "teacher_forced": ECHO.teacher_forced})
    with pytest.raises(ValueError, match="'echo' is already registered"):
        register_draft(other)
    assert register_draft(other, replace=True) is other and DRAFTS["echo"] is other
    for name in ("auto", "none", "two words"):
        with pytest.raises(ValueError, match="cannot name a draft"):
            register_draft(Draft(**{**ECHO.__dict__, "name": name}))
    with pytest.raises(TypeError, match="takes a mtp_jax.drafts.Draft"):
        register_draft("echo")
    # a draft with weights of its own tells the loader's shardings how to split them
    from mtp_jax.sharding import param_logical

    layout = {"params_group": "echo_w", "param_logical": lambda names, rank: ("vocab",) * rank}
    weighted = Draft(**{**ECHO.__dict__, **layout})
    register_draft(weighted, replace=True)
    assert param_logical("echo_w", ["head"], 2) == ("vocab", "vocab")
    with pytest.raises(mtp_jax.InvalidRequestError, match="unknown draft 'nope'"):
        mtp_jax.load(LLAMA, "float32").generate([[1, 2]], draft="nope")


def test_a_draft_of_several_sources_reports_them_and_must_return_them():
    """A draft that declares ``sources`` returns each row's source last: the statistics count its
    drafts by source; one that declares them and returns none is refused by name."""

    def by_parity(params, sc, state, page_table, rows, active, sampling, first_pos):
        drafts, q, state = _echo(params, sc, state, page_table, rows, active, sampling, first_pos)
        newest = at_rows(rows.next_tokens, rows.last)
        return drafts, q, state, (newest % 2).astype(jnp.int32)

    model = mtp_jax.load(LLAMA, "float32")
    parity = {"name": "parity", "sources": ("even", "odd"), "extend_and_propose": by_parity}
    register_draft(Draft(**{**ECHO.__dict__, **parity}))
    try:
        kw = dict(max_new_tokens=8, ignore_eos=True, num_speculative_tokens=2)
        out = model.generate(PROMPTS, draft="parity", **kw)
        by = out.stats["drafts_by_source"]
        assert set(by) == {"even", "odd"}, by  # the prompts' newest tokens: 8 and 3, 7
        assert sum(v["steps"] for v in by.values()) == sum(r["steps"] for r in out.request_stats)
        assert sum(v["drafts"] for v in by.values()) == out.stats["num_draft_tokens"]
        assert sum(v["accepted"] for v in by.values()) == out.stats["num_accepted_tokens"]
        first = out.request_stats[0]["drafts_by_source"]  # its first step echoes the prompt's 8
        assert first["even"]["steps"] >= 1, first
        # a request that speculates nothing (K = 0) verified no draft: every row-step of it is "none"
        mixed = model.generate(PROMPTS, draft="parity", **{**kw, "num_speculative_tokens": [2, 0, 1]})
        plain_row = mixed.request_stats[1]
        nothing = {"steps": plain_row["steps"], "drafts": 0, "accepted": 0}
        assert plain_row["drafts_by_source"] == {"none": nothing}, plain_row
    finally:
        unregister_draft("parity")
    silent = Draft(**{**ECHO.__dict__, "name": "silent", "sources": ("a", "b")})
    register_draft(silent)
    try:
        with pytest.raises(TypeError, match="'silent': extend_and_propose returned 3 values, expected 4"):
            model.generate(PROMPTS, max_new_tokens=4, draft="silent", num_speculative_tokens=2)
    finally:
        unregister_draft("silent")
