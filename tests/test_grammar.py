"""Grammar-constrained decoding inside the unified step (llguidance, the ``test`` extra): the
bitmask itself, valid and complete outputs with every draft method, exactness against the masked
target distribution computed by enumeration, untouched unconstrained neighbours, refusals."""

from __future__ import annotations

import collections
import json
import os
import re
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

import mtp_jax
from mtp_jax.grammar import mask_logits
from tests.conftest import EMBEDDED_MODEL, require_extra
from tests.test_acceptance import assert_distribution, powered_size

require_extra("llguidance", reason="grammar tests need the test extra (llguidance)")

SCHEMA = {  # a "hidden" schema: nothing in the package knows it
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["list", "dict", "set"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "kind", "ok"],
    "additionalProperties": False,
}
REGEX = r"(def|class) [a-z]{1,6}\((x|y)?\)"
TINY = r"(x|y|z)(0|1|2)"  # nine outputs, each a few tokens: the exact distribution is enumerable


MESH_CHILD = textwrap.dedent(
    """
    import os, sys, json
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import mtp_jax

    src, regex, schema = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    prompts = [[1, 40, 41, 42], [1, 50], [1, 60, 61], [1, 70, 71, 72, 73]]
    grammars = [{"regex": regex}, {"json_schema": schema}, None, {"regex": regex}]
    kw = dict(max_new_tokens=24, temperature=1.0, seed=[1, 2, 3, 4], draft="mtp", num_speculative_tokens=3,
              draft_sampling="sampled", grammar=grammars)
    want = mtp_jax.load(src, "float32").generate(prompts, **kw)
    sharded = mtp_jax.load(src, "float32", mesh=mtp_jax.make_mesh(data=2, expert=4))
    for masks in ("host", "callback"):
        got = sharded.generate(prompts, grammar_masks=masks, **kw)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons, masks
    print("GRAMMAR-MESH-OK", want.finish_reasons)
    """
)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(os.path.join(EMBEDDED_MODEL, "tokenizer.json"))


@pytest.fixture(scope="module")
def targets():
    """The embedded DeepSeek-V3 target alone (MTP) and beside its shipped EAGLE-3 and DFlash drafts."""
    models = {"mtp": mtp_jax.load(EMBEDDED_MODEL, "float32")}
    for method in ("eagle3", "dflash"):
        models[method] = mtp_jax.load(EMBEDDED_MODEL, "float32", draft_model=f"{EMBEDDED_MODEL}-{method}")
    return models


def _prompt(model, tok, text: str) -> list[int]:
    return tok.encode(text).ids


def test_mask_logits_reads_the_packed_bits():
    rng = np.random.default_rng(0)
    v = 70  # not a multiple of 32: the last word is partly padding
    allowed = rng.random((3, v)) < 0.3
    packed = np.zeros((3, 3), np.uint32)
    for r, t in zip(*np.nonzero(allowed), strict=True):
        packed[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    logits = rng.standard_normal((3, v)).astype(np.float32)
    got = np.asarray(mask_logits(jnp.asarray(logits), jnp.asarray(packed.view(np.int32))))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


def _check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "size", "kind", "ok"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["size"], int) and 0 <= obj["size"] <= 999 and not isinstance(obj["size"], bool)
    assert obj["kind"] in ("list", "dict", "set") and isinstance(obj["ok"], bool)


@pytest.mark.parametrize("method", ["mtp", "dflash", "mtp-tree", "mtp-dynamic"])  # EAGLE-3: callback test
def test_every_output_is_valid_and_complete(targets, tok, method):
    """Sampled generations at K = 3 under a JSON schema and a regex (half the rows each, plus
    unconstrained rows): all constrained outputs complete and valid; the unconstrained rows are
    exactly what they are without any grammar in the batch (checked with MTP). The MTP chain's
    twelve requests share eight slots (a freed slot's grammar state is the next request's); the
    other runs admit all twelve at once (each admission's row count compiles its own prefill). A
    dynamic tree's masks follow each row's own tree."""
    shape = {
        "-tree": {"depth": 3, "topk": 2, "nodes": 6},
        "-dynamic": {"depth": 3, "topk": 2, "dynamic": True},
    }
    tree = next((t for suffix, t in shape.items() if method.endswith(suffix)), None)
    method = method.split("-")[0]
    model = targets[method]
    texts = ["def main():\n", "import os\n", "class A:\n    x = ", "# comment\n"] * 3
    prompts = [_prompt(model, tok, t) for t in texts]
    grammars = [{"json_schema": SCHEMA}, {"regex": REGEX}, None] * 4
    k = {"speculative_tree": tree} if tree else {"num_speculative_tokens": 3}
    slots = 8 if method == "mtp" and not tree else len(prompts)
    kw = dict(max_new_tokens=48, temperature=1.0, seed=list(range(12)), draft=method, max_batch=slots, **k)
    dynamic = bool(tree and tree.get("dynamic"))  # its own shape per row; fixed (argmax) candidates
    kw["draft_sampling"] = "argmax" if dynamic else "sampled"
    out = model.generate(prompts, grammar=grammars, **kw)
    # the masks of unconstrained rows are all ones whatever the draft: one method shows it (on the
    # synchronous engine path a grammar uses, which must not change tokens either)
    free = None
    if method == "mtp" and not dynamic:  # (with a tree, too)
        free = model.generate(prompts, pipelined=False, **kw)
    for i, new in enumerate(out.tokens):
        if grammars[i] is None:
            assert free is None or new == free.tokens[i], i
    check_outputs(model, tok, grammars, out)


def check_outputs(model, tok, grammars, out) -> None:
    """Every constrained output complete and valid under its grammar."""
    for i, (g, new) in enumerate(zip(grammars, out.tokens, strict=True)):
        if g is None:
            continue
        text = tok.decode([t for t in new if t not in model.eos_token_ids])
        assert out.finish_reasons[i] in ("grammar", "eos"), (i, text, out.finish_reasons[i])
        if "json_schema" in g:
            _check_schema(text)
        else:
            assert re.fullmatch(g["regex"], text), text
    assert out.stats["num_draft_tokens"] > 0 and out.stats["grammar_seconds"] > 0


def _exact_outputs(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Every token sequence the TINY grammar admits from ``prompt``, with its exact probability
    under the masked target distribution (temperature 1), by enumeration with llguidance's masks
    and teacher-forced logits."""
    import llguidance

    from mtp_jax.grammar import Constraints, grammar_text

    c = Constraints(model.tokenizer_path, model.config.vocab_size, model.eos_token_ids, [None])
    out: dict[tuple[int, ...], float] = {}

    def walk(seq: list[int], prob: float) -> None:
        m = llguidance.LLMatcher(c.tokenizer, grammar_text({"regex": TINY}), log_level=0)
        assert all(m.consume_token(t) for t in seq)
        if m.is_stopped():
            out[tuple(seq)] = prob
            return
        bits = np.zeros((1, c.words), np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(c._executor, [(m, 0)], bits)
        logits = model.logits([prompt + seq])[0, -1]
        masked = np.asarray(mask_logits(jnp.asarray(logits), jnp.asarray(bits[0])), np.float64)
        p = np.exp(masked - masked.max())
        p /= p.sum()
        for t in np.nonzero(p > 0)[0]:
            walk([*seq, int(t)], prob * p[t])

    walk([], 1.0)
    return out


@pytest.mark.optimized  # its time is running: 103 s at XLA's level 2, 178 at level 0
@pytest.mark.parametrize(
    ("method", "draft_sampling", "tree"),
    [
        ("mtp", "sampled", None),
        ("dflash", "argmax", None),
        ("mtp", "sampled", {"depth": 3, "topk": 2, "nodes": 6}),
    ],
    ids=["mtp-sampled", "dflash-argmax", "mtp-sampled-tree"],
)
def test_outputs_follow_the_exact_masked_distribution(targets, tok, method, draft_sampling, tree):
    """Sampled generations (K = 3, the drafts know nothing of the grammar; as many as the check's
    power needs) against the exact probability of each of the grammar's outputs: Pearson chi-square, for a
    chained draft with sampled drafts, a block draft with argmax drafts, and a token tree (each
    node's mask along its own path)."""
    model = targets[method]
    prompt = _prompt(model, tok, "point = ")
    exact = _exact_outputs(model, prompt)
    assert len(exact) >= 9 and abs(sum(exact.values()) - 1) < 1e-6
    law = np.array(list(exact.values()))
    n = powered_size(law, step=1024)
    out = model.generate(
        [prompt] * n,
        max_new_tokens=8,
        temperature=1.0,
        seed=list(range(n)),
        draft=method,
        draft_sampling=draft_sampling,
        grammar={"regex": TINY},
        max_batch=256,
        **({"num_speculative_tokens": 3} if tree is None else {"speculative_tree": tree}),
    )
    seqs = list(exact)
    index = {s: i for i, s in enumerate(seqs)}
    counts = collections.Counter(tuple(t) for t in out.tokens)
    assert set(counts) <= set(exact), set(counts) - set(exact)
    samples = np.array([index[tuple(t)] for t in out.tokens])
    assert_distribution(samples, law, f"{method} {draft_sampling}")


@pytest.mark.parametrize(
    ("grammar", "match"),
    [
        ({"regex": "("}, "grammar of prompt 0 is invalid"),
        ({"regex": ""}, "non-empty string"),
        ({"json_schema": "{"}, "not valid JSON"),
        ({"lark": "start: x"}, "invalid"),
        ({"regex": "a", "lark": "start: 'a'"}, "exactly one of"),
        ({"type": "json_schema"}, "json_schema.schema"),
        ("[0-9]+", "a dict with one of"),
        ([{"regex": "a"}], "1 values for 2 prompts"),
    ],
)
def test_bad_grammars_are_named(targets, grammar, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        targets["mtp"].generate([[3, 4], [5]], max_new_tokens=2, grammar=grammar)


def test_response_format_and_lark(targets, tok):
    model = targets["mtp"]
    prompt = _prompt(model, tok, "x = ")
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    out = model.generate([prompt], max_new_tokens=48, grammar=fmt, draft="mtp")
    _check_schema(tok.decode(out.tokens[0]))
    lark = 'start: "[" NUM ("," NUM)? ("," NUM)? "]"\nNUM: /[0-9]{1,2}/'
    out = model.generate([prompt], max_new_tokens=24, grammar={"lark": lark}, draft="mtp", temperature=0.8)
    assert out.finish_reasons == ["grammar"]
    assert re.fullmatch(r"\[[0-9]{1,2}(,[0-9]{1,2}){0,2}\]", tok.decode(out.tokens[0])), tok.decode(
        out.tokens[0]
    )


@pytest.mark.child(MESH_CHILD, EMBEDDED_MODEL, REGEX, json.dumps(SCHEMA))
def test_grammar_on_an_expert_parallel_mesh(child_output):
    """8 simulated devices (data 2 x expert 4), both mask deliveries: the single device's tokens."""
    assert "GRAMMAR-MESH-OK" in child_output


def test_callback_delivery_gives_the_host_delivery_tokens(targets, tok):
    """EAGLE-3 drafts under grammars, mixed per-request K: every output valid and complete, and the
    in-step callback (which reconstructs each row's emitted tokens from the state) gives the host
    delivery's tokens; with sampling and per-row seeds any slip would change them. (Argmax drafts:
    with sampled drafts a row's tokens depend on the last bits of its logits, which differ between
    the step programs of different K, and the two deliveries run different K sequences when
    requests ask for different K. The mesh test compares sampled drafts at one K.)"""
    model = targets["eagle3"]
    prompts = [_prompt(model, tok, t) for t in ["def f(x):\n", "import re\n", "y = ", "class B:\n"] * 2]
    grammars = [{"json_schema": SCHEMA}, {"regex": REGEX}, None, {"regex": TINY}] * 2
    kw = dict(max_new_tokens=48, temperature=1.0, seed=list(range(8)), draft="eagle3", grammar=grammars)
    kw.update(num_speculative_tokens=[3, 1, 2, 0, 3, 3, 1, 2], draft_sampling="argmax", max_batch=4)
    host = model.generate(prompts, grammar_masks="host", **kw)
    callback = model.generate(prompts, grammar_masks="callback", **kw)
    check_outputs(model, tok, grammars, host)
    assert callback.tokens == host.tokens and callback.finish_reasons == host.finish_reasons
    assert "grammar" in host.finish_reasons
    with pytest.raises(ValueError, match="grammar masks of a token tree come from the host"):
        model.generate(
            prompts[:1],
            grammar={"regex": TINY},
            grammar_masks="callback",
            speculative_tree={"depth": 2, "topk": 2},
            draft="eagle3",
        )
    with pytest.raises(ValueError, match="grammar_masks must be one of"):
        model.generate(prompts, grammar_masks="device", **kw)


def test_the_in_step_callback_finds_its_own_constraints_by_key():
    """Two schedulers' constraints live side by side: the step's callback reaches the one whose key
    the step carries (no process-wide "current" constraints), and a released one is named."""
    import gc

    from mtp_jax import grammar

    require_extra("llguidance")
    model = mtp_jax.load(EMBEDDED_MODEL, "float32")
    args = (model.tokenizer_path, model.config.vocab_size, model.eos_token_ids)
    digits, letters = (
        grammar.Constraints(*args, [{"regex": "[0-9]+"}]),
        grammar.Constraints(*args, [{"regex": "[a-z]+"}]),
    )
    assert digits.key != letters.key
    tok = Tokenizer.from_file(model.tokenizer_path)
    for c, ok in ((digits, "7"), (letters, "q")):
        c.start(0, [1, 2, 3])  # admitted as the scheduler admits it; its first token is `ok`
        step = (np.array([0]), np.array([3]), np.array([tok.token_to_id(ok)]), np.zeros((1, 1), np.int32))
        masks = grammar._callback(np.int32(c.key), *step)
        allowed = {i for i in range(model.config.vocab_size) if masks[0, 0, i // 32] >> (i % 32) & 1}
        assert tok.token_to_id(ok) in allowed and allowed != set(range(model.config.vocab_size))
    key = letters.key
    del letters, c  # the loop variable held it too
    gc.collect()
    with pytest.raises(RuntimeError, match=f"constraints \\(key {key}\\) were released"):
        grammar._callback(np.int32(key), *step)
    assert grammar._BY_KEY[digits.key] is digits


def test_requests_sharing_a_grammar_compile_it_once(monkeypatch):
    """A grammar shared by many requests (a server's JSON schema, a batch's regex) is validated and
    built once; each request still gets its own matcher, starting fresh; the cache is bounded and a
    bad grammar is refused however many good ones came before."""
    import llguidance

    from mtp_jax import grammar

    model = mtp_jax.load(EMBEDDED_MODEL, "float32")
    c = grammar.Constraints(model.tokenizer_path, model.config.vocab_size, model.eos_token_ids)
    calls = collections.Counter()
    real_validate, real_matcher = llguidance.LLMatcher.validate_grammar, llguidance.LLMatcher

    class Counting:  # llguidance's matcher type cannot be subclassed: stand in for the class
        def __call__(self, *a, **k):
            calls["built"] += 1
            return real_matcher(*a, **k)

        def validate_grammar(self, *a, **k):
            calls["validated"] += 1
            return real_validate(*a, **k)

        def __getattr__(self, name):
            return getattr(real_matcher, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    tok = Tokenizer.from_file(model.tokenizer_path)
    x = tok.token_to_id("x")
    for req in range(5):
        c.add(req, {"regex": TINY})
        c.start(req, [0, 1])
    assert calls == {"validated": 1, "built": 1}
    assert not c.consume(0, x)  # request 0 advances; request 1's matcher is untouched
    assert c.matchers[1].consume_token(x) and not c.matchers[1].is_stopped()
    with pytest.raises(mtp_jax.InvalidRequestError, match="grammar of the request is invalid"):
        c.add(9, {"regex": "("})
    monkeypatch.setattr(grammar, "COMPILED_GRAMMARS", 2)
    for n in range(4):
        c.add(10 + n, {"regex": f"a{{{n + 1}}}"})
    assert len(c._compiled) == 2 and calls["validated"] == 6  # TINY's and the first two evicted
    c.add(20, {"regex": TINY})
    c.start(20, [0, 1])
    assert calls["validated"] == 7 and calls["built"] == 2
