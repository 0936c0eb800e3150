"""The suffix draft (mtp_jax/drafts/suffix/): its matching and its frequency tree against
plain-Python references of the paper's rules; the host index's counts, eviction and keys against
the device's; greedy speculation lossless (chains and dynamic trees) with drafts accepted; the
engine-wide index accepting earlier outputs, and never another tenant's; its options checked. Its
exactness under sampling (with the index proposing) is in tests/test_acceptance.py."""

from __future__ import annotations

import collections
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.drafts.suffix.config import SuffixConfig
from mtp_jax.drafts.suffix.index import INDEX_DEPTH, SuffixIndex
from mtp_jax.drafts.suffix.tree import (
    context_keys,
    continuations,
    frequency_tree,
    host_key,
    latest_occurrences,
)
from mtp_jax.errors import InvalidRequestError
from mtp_jax.server import prometheus_text
from tests.conftest import EMBEDDED_MODEL, cli_run

# -- the rules, in plain Python ------------------------------------------------------------------


def reference_occurrences(history: list[int], max_m: int, min_m: int, count: int):
    """(ends, m): the latest ``count`` ends of earlier occurrences of the longest suffix of
    min_m..max_m tokens that occurred before, newest first; ([], 0) without one."""
    n = len(history)
    for m in range(min(max_m, n), min_m - 1, -1):
        ends = [e for e in range(n - 2, m - 2, -1) if history[e - m + 1 : e + 1] == history[n - m :]]
        if ends:
            return ends[:count], m
    return [], 0


def reference_tree(cont, weight, nodes: int, width: int, budget: int, min_prob: float):
    """The paper's greedy tree: prefixes of the continuations scored by the share of weight through
    them; best first (ties: shallower, then the earlier continuation), a node's children limited to
    its ``width`` best, none under ``min_prob``, at most min(nodes, budget). Returns the chosen
    prefixes in order."""
    total = sum(w for w in weight if w > 0)
    count, first = collections.Counter(), {}
    for p, (c, w) in enumerate(zip(cont, weight, strict=True)):
        if w <= 0:
            continue
        for d in range(len(c)):
            if c[d] < 0:
                break
            prefix = tuple(c[: d + 1])
            count[prefix] += w
            first.setdefault(prefix, p)
    prob = {k: v / total for k, v in count.items()}

    def order(k):
        return (-prob[k], len(k), first[k])

    eligible = set()
    for k in prob:
        siblings = sorted((s for s in prob if len(s) == len(k) and s[:-1] == k[:-1]), key=order)
        if k in siblings[:width] and prob[k] >= min_prob:
            eligible.add(k)
    eligible = {k for k in eligible if all(k[:i] in eligible for i in range(1, len(k)))}
    return sorted(eligible, key=order)[: min(nodes, budget)]


def prefixes_of(tokens, parent) -> list[tuple[int, ...]]:
    """The prefix (path of tokens from the root) of each proposed node, in node order."""
    paths = []
    for t, p in zip(tokens, parent, strict=True):
        if t < 0:
            break
        paths.append((paths[p - 1] if p > 0 else ()) + (int(t),))
    return paths


_tree = jax.jit(frequency_tree, static_argnames=("nodes", "width", "min_prob"))


def test_frequency_tree_matches_the_papers_greedy_tree():
    rng = np.random.default_rng(0)
    for case in range(60):
        p, d = rng.integers(1, 7), rng.integers(1, 5)
        cont = rng.integers(0, 3, (p, d))
        for i in range(p):  # some continuations end early
            cut = rng.integers(1, d + 1)
            cont[i, cut:] = -1
        weight = rng.integers(0, 4, p).astype(np.float32)
        nodes, width, budget = int(rng.integers(1, 7)), int(rng.integers(1, 3)), int(rng.integers(0, 8))
        min_prob = float(rng.choice([0.0, 0.1, 0.3]))
        tokens, parent, score = _tree(
            jnp.asarray(cont[None], jnp.int32),
            jnp.asarray(weight[None]),
            nodes=nodes,
            width=width,
            budget=jnp.asarray([budget]),
            min_prob=min_prob,
        )
        tokens, parent = np.asarray(tokens)[0].tolist(), np.asarray(parent)[0].tolist()
        want = reference_tree(cont.tolist(), weight.tolist(), nodes, width, budget, min_prob)
        got = prefixes_of(tokens, parent)
        assert got == want, (case, cont.tolist(), weight.tolist(), nodes, width, budget, min_prob)
        assert all(t == -1 for t in tokens[len(got) :]), tokens  # nothing after the last node
        assert all(parent[i] <= i for i in range(len(got))), parent  # every node after its parent
        total = weight[weight > 0].sum()
        expected = sum(
            sum(w for c, w in zip(cont.tolist(), weight, strict=True) if w > 0 and tuple(c[: len(k)]) == k)
            for k in want
        ) / max(total, 1)
        assert float(score[0]) == pytest.approx(expected, abs=1e-6)


def test_occurrences_and_continuations_match_the_reference():
    rng = np.random.default_rng(1)
    width, depth, count = 40, 5, 4
    histories = [list(rng.integers(0, 3, rng.integers(1, width))) for _ in range(40)]
    histories += [[5, 6, 7, 5, 6], [1, 2, 3, 4], [9, 9, 9, 9, 9, 9]]
    padded = rng.integers(0, 50, (len(histories), width)).astype(np.int32)  # garbage past the end
    for i, h in enumerate(histories):
        padded[i, : len(h)] = h
    n = jnp.asarray([len(h) for h in histories], jnp.int32)
    ends, m = jax.jit(latest_occurrences, static_argnums=(2, 3, 4))(jnp.asarray(padded), n, 6, 2, count)
    cont = np.asarray(continuations(jnp.asarray(padded), ends, n, depth))
    for i, h in enumerate(histories):
        want_ends, want_m = reference_occurrences(h, 6, 2, count)
        assert int(m[i]) == want_m, (h, int(m[i]), want_m)
        got = [e for e in np.asarray(ends[i]).tolist() if e >= 0]
        assert got == want_ends, (h, got, want_ends)
        for j, e in enumerate(want_ends):
            period = len(h) - 1 - e
            assert cont[i, j].tolist() == [h[e + 1 + t % period] for t in range(depth)]
        assert (cont[i, len(want_ends) :] == -1).all()


# -- the host index ------------------------------------------------------------------------------


def test_host_keys_are_the_devices():
    rng = np.random.default_rng(2)
    recent = rng.integers(0, 60000, (5, 6)).astype(np.int32)
    tenant = np.asarray([0, 1, 7, 2**20, 3], np.int32)
    keys = np.asarray(context_keys(jnp.asarray(recent), jnp.asarray(tenant), 6))
    for b in range(5):
        for j in range(6):
            assert int(keys[b, j]) == host_key(recent[b, : j + 1].tolist(), int(tenant[b]))
    assert host_key([1, 2], 0) != host_key([1, 2], 1) != host_key([2, 1], 0)


def test_index_counts_forgets_the_oldest_and_keeps_the_most_frequent():
    cfg = SuffixConfig(min_match=2, index_match=3, index_slots=1024, index_paths=2, index_outputs=2)
    index = SuffixIndex(cfg)
    index.finished([1, 2], [3, 4, 5], tenant=0)
    # contexts of 2..3 tokens before each output position, newest token first
    assert index.counts[(0, (2, 1))] == {(3, 4, 5): 1}
    assert index.counts[(0, (3, 2, 1))] == {(4, 5): 1}
    assert (1, (2, 1)) not in index.counts  # per tenant
    index.finished([1, 2], [3, 9], tenant=0)
    index.finished([1, 2], [3, 4, 5], tenant=0)  # the first output is forgotten
    assert index.counts[(0, (2, 1))] == {(3, 9): 1, (3, 4, 5): 1}
    slots, rows = index.updates()
    i = list(slots).index(host_key((2, 1), 0) & 1023)
    assert rows["length"][i] == 2 and rows["context"][i].tolist() == [2, 1, -1]
    # the two continuations, most frequent first (ties: in token order)
    assert rows["continuation"][i, 0, :3].tolist() == [3, 4, 5] and rows["count"][i].tolist() == [1, 1]
    assert rows["continuation"][i, 1, :2].tolist() == [3, 9] and rows["continuation"][i, 1, 2] == -1
    assert rows["continuation"].shape[-1] == INDEX_DEPTH
    assert index.updates() is None  # nothing new
    index.finished([7], [8, 8], tenant=1)
    index.finished([7], [8, 8], tenant=1)  # both tenant-0 outputs forgotten: their entries emptied
    slots, rows = index.updates()
    i = list(slots).index(host_key((2, 1), 0) & 1023)
    assert rows["length"][i] == 0
    assert not any(k[0] == 0 for k in index.counts)


def test_options_are_checked():
    with pytest.raises(InvalidRequestError, match="power of two"):
        SuffixConfig(index_slots=1000)
    with pytest.raises(InvalidRequestError, match="min_match <= max_match"):
        SuffixConfig(min_match=5, max_match=3)
    with pytest.raises(InvalidRequestError, match="min_prob"):
        SuffixConfig(min_prob=1.5)
    with pytest.raises(InvalidRequestError, match="widths must be a list of positive integers"):
        SuffixConfig(widths="2,3")
    assert SuffixConfig(widths=[3, 2, 3]).widths == (2, 3)  # hashable, ascending


# -- through generate ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return mtp_jax.load(EMBEDDED_MODEL, "float32")


def encode(model, text: str) -> list[int]:
    return model.text.tokenizer.encode(text).ids


REPEATING = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("
TREE = {"depth": 4, "topk": 2, "nodes": 6, "dynamic": True}


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "dynamic-tree"])
def test_greedy_is_lossless_with_drafts_accepted(model, tree):
    prompts = [encode(model, REPEATING), encode(model, "import os\n"), encode(model, REPEATING)[:7]]
    plain = model.generate(prompts, max_new_tokens=40, ignore_eos=True)
    spec = model.generate(
        prompts,
        max_new_tokens=40,
        ignore_eos=True,
        draft="suffix",
        **({"speculative_tree": tree} if tree else {"num_speculative_tokens": 4}),
    )
    assert spec.tokens == plain.tokens
    assert spec.stats["acceptance_length"] > 1.3, spec.stats  # drafts were proposed and accepted
    if tree:  # each row's tree counted at its own size (its proposed nodes), some below the budget
        sizes = spec.stats["steps_per_verified_drafts"]  # row-steps by the drafts they verified
        assert len(sizes) == TREE["nodes"] + 1 and sum(sizes[1:-1]) > 0, sizes
        assert spec.stats["num_draft_tokens"] < TREE["nodes"] * spec.stats["num_drafts"], spec.stats


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_step_verifies_at_the_narrowest_width_that_holds_its_rows_drafts(model, temperature):
    """Short suffix chains (half a node per matched token) with widths 2 and 3 compiled in: steps
    run at those widths where every row proposed that few drafts, and the tokens, steps and accepted
    drafts are those of the same run verifying K + 1 (every proposed draft is verified either way,
    and the acceptance draws are keyed by position, not by width)."""
    prompts = [encode(model, REPEATING), encode(model, "import os\n"), encode(model, REPEATING)[:9]]
    settings = dict(
        max_new_tokens=40, ignore_eos=True, num_speculative_tokens=4, temperature=temperature, seed=3
    )
    wide = model.generate(prompts, draft="suffix", draft_options={"spec_factor": 0.5}, **settings)
    narrow = model.generate(
        prompts, draft="suffix", draft_options={"spec_factor": 0.5, "widths": [2, 3]}, **settings
    )
    assert narrow.tokens == wide.tokens
    assert narrow.stats["steps"] == wide.stats["steps"]
    assert narrow.stats["num_accepted_tokens"] == wide.stats["num_accepted_tokens"] > 0
    assert set(wide.stats["steps_per_width"]) <= {"1", "5"}
    assert set(narrow.stats["steps_per_width"]) & {"2", "3"}, narrow.stats["steps_per_width"]
    assert sum(narrow.stats["steps_per_width"].values()) == narrow.stats["steps"]


def test_a_hybrid_verifies_its_neural_drafts_at_their_own_width(model):
    """suffix_mtp at K = 5 with MTP's 3: rows that draft from the MTP layer verify 4 tokens, not 6."""
    prompts = [encode(model, "import os\n"), encode(model, "class Stack:\n")]
    settings = dict(max_new_tokens=24, ignore_eos=True, num_speculative_tokens=5)
    neural = model.generate(prompts, draft="suffix_mtp", draft_options={"threshold": 1e9}, **settings)
    assert neural.tokens == model.generate(prompts, max_new_tokens=24, ignore_eos=True).tokens
    assert set(neural.stats["steps_per_width"]) == {"4"}, neural.stats["steps_per_width"]


def repeated_requests(model, prompts, **options):
    """Three requests one after another (one slot): what the index learns from the first ones."""
    return model.generate(
        prompts,
        max_new_tokens=48,
        ignore_eos=True,
        max_batch=1,
        draft="suffix",
        num_speculative_tokens=8,
        draft_options=options,
    )


def check_sources(result, names) -> None:
    """``drafts_by_source`` (run and requests) uses only ``names``, and adds up to the row-steps,
    the drafts verified and the drafts accepted (no proposal: no drafts)."""
    for stats in (result.stats, *result.request_stats):
        by = stats["drafts_by_source"]
        assert set(by) <= set(names), by
        assert sum(v["drafts"] for v in by.values()) == stats["num_draft_tokens"]
        assert sum(v["accepted"] for v in by.values()) == stats["num_accepted_tokens"]
        assert by.get("none", {"drafts": 0})["drafts"] == 0
    row_steps = sum(r["steps"] for r in result.request_stats)
    assert sum(v["steps"] for v in result.stats["drafts_by_source"].values()) == row_steps


def test_the_index_proposes_earlier_outputs_and_never_another_tenants(model):
    prompt = encode(model, "import os\nclass Reader:\n    def __init__(self, path):\n")
    plain = model.generate([prompt], max_new_tokens=48, ignore_eos=True).tokens[0]
    alone = repeated_requests(model, [prompt] * 3, index_slots=0)
    learned = repeated_requests(model, [prompt] * 3)
    assert alone.tokens == learned.tokens == [plain] * 3
    check_sources(alone, ("text", "none"))
    check_sources(learned, ("text", "index", "none"))
    # the index learns a request's output when it finishes: the first request drafts from its own
    # text only, the later ones mostly from the index, and accept those drafts
    first, *later = (r["drafts_by_source"] for r in learned.request_stats)
    assert "index" not in first
    assert all(by["index"]["accepted"] > by.get("text", {"accepted": 0})["accepted"] for by in later), later
    # the second and third requests accept the first's output: far fewer steps
    assert learned.stats["acceptance_length"] > alone.stats["acceptance_length"] + 1.0, (
        learned.stats["acceptance_length"],
        alone.stats["acceptance_length"],
    )
    # each request its own tenant (cache salt): exactly the drafts of the index switched off
    salted = model.generate(
        [prompt] * 3,
        [mtp_jax.SamplingParams(max_new_tokens=48, ignore_eos=True, cache_salt=s) for s in "abc"],
        max_batch=1,
        draft="suffix",
        num_speculative_tokens=8,
    )
    assert salted.tokens == alone.tokens
    for key in ("steps", "num_draft_tokens", "num_accepted_tokens"):
        assert salted.stats[key] == alone.stats[key], key
    # one salt shared: learned again
    shared = model.generate(
        [prompt] * 3,
        [mtp_jax.SamplingParams(max_new_tokens=48, ignore_eos=True, cache_salt="t")] * 3,
        max_batch=1,
        draft="suffix",
        num_speculative_tokens=8,
    )
    assert shared.stats["steps"] == learned.stats["steps"]


def test_a_static_tree_or_an_unknown_option_is_refused(model):
    prompt = encode(model, "import os\n")
    with pytest.raises(InvalidRequestError, match="slots.*is a setting of draft="):
        model.generate([prompt], max_new_tokens=4, draft="suffix", draft_options={"slots": 4})
    with pytest.raises(InvalidRequestError, match="dynamic"):
        model.generate([prompt], max_new_tokens=4, draft="suffix", speculative_tree={"depth": 2, "topk": 2})


def test_the_engine_learns_across_requests(model):
    """The serving engine keeps one index for its life: a request after an identical one accepts
    its output; a request of another tenant (cache salt) does not."""
    prompt = encode(model, "import os\nclass Reader:\n    def __init__(self, path):\n")
    plain = model.generate([prompt], max_new_tokens=40, ignore_eos=True).tokens[0]
    with mtp_jax.Engine(model, slots=2, max_len=128, draft="suffix", num_speculative_tokens=8) as engine:
        runs = []
        for salt in (None, None, "other"):
            handle = engine.submit(prompt, max_new_tokens=40, ignore_eos=True, cache_salt=salt)
            runs.append(handle.result(timeout=300))
        engine_stats = engine.stats()
    assert [list(r.tokens) for r in runs] == [plain] * 3
    steps = [r.stats["steps"] for r in runs]
    assert steps[1] < steps[0] / 2, steps  # the second read the first's output from the index
    assert steps[2] == steps[0], steps  # another tenant: its own text only, as the first
    learned = engine_stats["draft_learned"]
    assert learned["outputs"] == 3 and learned["contexts"] > 0 and learned["entries_written"] > 0, learned
    # the second request drafted from the index, the first and the other tenant's never
    by = [r.stats["drafts_by_source"] for r in runs]
    assert by[1]["index"]["accepted"] > 0 and "index" not in by[0] and "index" not in by[2], by
    text = prometheus_text(engine_stats, "m").splitlines()
    name = 'mtp_jax:spec_decode_drafts_by_source_total{model_name="m",source="index",count="accepted"}'
    assert f"{name} {engine_stats['drafts_by_source']['index']['accepted']}" in text


SHARDED_CHILD = textwrap.dedent(
    """
    import os, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    assert len(jax.devices()) == 8
    import mtp_jax
    from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from tests.conftest import TINY_CONFIG
    from tests.drafts.test_eagle3 import TARGET

    ds_target = os.path.join(tempfile.mkdtemp(), "ds")
    write_hub_checkpoint(ds_target, TINY_CONFIG, hub_tensors(DeepseekV3Config.from_dict(TINY_CONFIG), seed=0))
    prompts = [[5, 9, 17, 3, 5, 9], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77], [10], [8, 8, 8, 8, 8, 8]] * 4
    # two waves of 8 (a mesh's rows split over 8 devices): the second drafts from the first's outputs
    chain = dict(max_new_tokens=10, ignore_eos=True, draft="suffix", num_speculative_tokens=3, max_batch=8)
    tree = dict(chain, num_speculative_tokens=None,
                speculative_tree={"depth": 3, "topk": 2, "nodes": 4, "dynamic": True})
    for target, axes in [(TARGET, dict(data=4, tensor=2)), (ds_target, dict(data=2, expert=4))]:
        one = mtp_jax.load(target, "float32", page_size=4)
        model = mtp_jax.load(target, "float32", page_size=4, mesh=mtp_jax.make_mesh(**axes))
        for spec in (chain, tree):
            want = one.generate(prompts, **spec)
            out = model.generate(prompts, **spec)
            assert out.tokens == want.tokens, (target, axes, spec)
            # the second wave repeats the first: drafted from the index, on every shard alike
            assert out.stats["num_accepted_tokens"] == want.stats["num_accepted_tokens"] > 40, (
                out.stats, want.stats)
    # the hybrid's trees (the suffix tree or the MTP layer's, per row) under expert parallelism
    hybrid = dict(tree, draft="suffix_mtp")
    want, out = one.generate(prompts, **hybrid), model.generate(prompts, **hybrid)
    assert out.tokens == want.tokens and out.stats["drafts_by_source"] == want.stats["drafts_by_source"]
    assert set(want.stats["drafts_by_source"]) >= {"index", "neural"}, want.stats["drafts_by_source"]
    print("SUFFIX-SHARDED-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(SHARDED_CHILD)
def test_sharded_like_one_device(child_output):
    assert "SUFFIX-SHARDED-OK" in child_output


@pytest.mark.spawns
def test_the_command_line_takes_its_options(capsys):
    from mtp_jax.cli import _draft_option

    assert _draft_option("max_match=16") == ("max_match", 16)
    assert _draft_option("min_prob=0.25") == ("min_prob", 0.25)
    assert _draft_option(" name = text") == ("name", " text")
    with pytest.raises(Exception, match="KEY=VALUE"):
        _draft_option("max_match")
    base = ["generate", "--model", EMBEDDED_MODEL, "--prompt", "import os"]
    code, err = cli_run(capsys, *base, "--draft", "suffix", "-k", "4", "--draft-option", "max_match=6",
                        "--max-new-tokens", "6")  # fmt: skip
    assert code == 0, err
    code, err = cli_run(capsys, *base, "--draft", "suffix", "--draft-option", "index_slots=1000",
                        "--max-new-tokens", "2")  # fmt: skip
    assert code != 0 and "index_slots must be 0 or a power of two" in err


def test_the_index_starts_from_a_seed_file(model, tmp_path):
    """Outputs written to a file earlier (as a server's log would hold them) are drafted from by
    the first request; a malformed line is refused by number."""
    import json

    prompt = encode(model, "import os\nclass Reader:\n    def __init__(self, path):\n")
    plain = model.generate([prompt], max_new_tokens=48, ignore_eos=True).tokens[0]
    seed = tmp_path / "outputs.jsonl"
    seed.write_text(json.dumps({"prompt": prompt, "output": plain}) + "\n\n")
    settings = dict(max_new_tokens=48, ignore_eos=True, draft="suffix", num_speculative_tokens=8)
    cold = model.generate([prompt], **settings)
    warm = model.generate([prompt], **settings, draft_options={"index_seed": str(seed)})
    assert warm.tokens == cold.tokens == [plain]
    assert warm.stats["steps"] < cold.stats["steps"] / 2, (warm.stats["steps"], cold.stats["steps"])
    other = tmp_path / "other.jsonl"  # another tenant's outputs: not proposed
    other.write_text(json.dumps({"prompt": prompt, "output": plain, "cache_salt": "them"}) + "\n")
    assert (
        model.generate([prompt], **settings, draft_options={"index_seed": str(other)}).stats["steps"]
        == (cold.stats["steps"])
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": prompt, "output": plain}) + "\n" + '{"output": ["a"]}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2"):
        model.generate([prompt], **settings, draft_options={"index_seed": str(bad)})
    with pytest.raises(InvalidRequestError, match="index_seed must name a file"):
        model.generate([prompt], **settings, draft_options={"index_seed": str(tmp_path / "none")})


# -- hybrid: suffix decoding with a neural fallback -----------------------------------------------


def test_hybrid_is_lossless_and_falls_back_to_the_neural_draft(model):
    """suffix_mtp: greedy tokens are plain decoding's; with an unreachable threshold every row
    drafts from the MTP layer (the same steps and counts as draft="mtp"); with the default one the
    repeated text is drafted from the suffix tree (fewer steps than the MTP layer alone)."""
    prompts = [encode(model, REPEATING), encode(model, "import os\n")]
    settings = dict(max_new_tokens=40, ignore_eos=True, num_speculative_tokens=4)
    plain = model.generate(prompts, max_new_tokens=40, ignore_eos=True).tokens
    mtp = model.generate(prompts, draft="mtp", **settings)
    never = model.generate(
        prompts, draft="suffix_mtp", draft_options={"threshold": 1e9, "neural_k": 4}, **settings
    )
    hybrid = model.generate(prompts, draft="suffix_mtp", **settings)
    assert mtp.tokens == never.tokens == hybrid.tokens == plain
    for key in ("steps", "num_draft_tokens", "num_accepted_tokens"):
        assert never.stats[key] == mtp.stats[key], key
    check_sources(never, ("neural",))
    check_sources(hybrid, ("text", "neural"))  # the index learns only when a request finishes
    assert hybrid.stats["drafts_by_source"]["text"]["accepted"] > 0
    assert hybrid.stats["drafts_by_source"]["neural"]["drafts"] > 0
    assert "drafts_by_source" not in mtp.stats  # a draft of one source
    suffix = model.generate(prompts, draft="suffix", **settings)
    assert hybrid.stats["steps"] != mtp.stats["steps"]  # some rows drafted from their text
    assert hybrid.stats["acceptance_length"] >= 0.95 * max(
        mtp.stats["acceptance_length"], suffix.stats["acceptance_length"]
    ), (hybrid.stats["acceptance_length"], mtp.stats["acceptance_length"], suffix.stats["acceptance_length"])


def test_a_hybrid_verifies_either_tree_per_row(model):
    """suffix_mtp with a dynamic tree: each row verifies its suffix tree or the MTP layer's EAGLE-2
    tree of the same budget; greedy tokens are plain decoding's, both kinds were verified and
    accepted, and with an unreachable threshold the run is the MTP tree's step for step; a static
    tree (sampled siblings) is refused by name."""
    prompts = [encode(model, REPEATING), encode(model, "import os\n")]
    settings = dict(max_new_tokens=40, ignore_eos=True, speculative_tree=TREE)
    plain = model.generate(prompts, max_new_tokens=40, ignore_eos=True).tokens
    mtp = model.generate(prompts, draft="mtp", **settings)
    hybrid = model.generate(prompts, draft="suffix_mtp", **settings)
    never = model.generate(prompts, draft="suffix_mtp", draft_options={"threshold": 1e9}, **settings)
    assert mtp.tokens == hybrid.tokens == never.tokens == plain
    for key in ("steps", "num_draft_tokens", "num_accepted_tokens"):
        assert never.stats[key] == mtp.stats[key], key  # the neural tree alone: the MTP run's
    check_sources(never, ("neural",))
    check_sources(hybrid, ("text", "neural"))
    by_source = hybrid.stats["drafts_by_source"]
    assert by_source["text"]["accepted"] > 0 and by_source["neural"]["accepted"] > 0, by_source
    static = {key: TREE[key] for key in ("depth", "topk", "nodes")}
    with pytest.raises(InvalidRequestError, match="chooses each row's tree"):
        model.generate(prompts, draft="suffix_mtp", speculative_tree=static, max_new_tokens=4)
