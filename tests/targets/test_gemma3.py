"""Gemma 3 target (its own folder, one registration): parity with transformers' Gemma3ForCausalLM on
committed hub-layout fixtures (scripts/make_gemma3_parity_fixtures.py) whose sliding windows are a
few tokens wide, so every check below crosses them: teacher-forced logits and hidden states, greedy
decoding through the paged cache, speculation lossless with the drafts (verification of several
tokens per row over the window), the tools that derive from the declared layer tree, and the
refusals."""

from __future__ import annotations

import dataclasses
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader, save_safetensors
from tests.conftest import REPO, assert_speculated, check_lossless, greedy_reference
from tests.targets.test_llama3 import _copy as _copy_fixture
from tests.targets.test_llama3 import _edit_config, load_fixtures, rel_err

FIXTURES = os.path.join(REPO, "tests", "fixtures", "parity_gemma3")
NAMES = ["pattern6_tied", "mixed_softcap_linear_untied", "all_global_pattern1"]
PROMPTS = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [100], [8, 8, 8, 8, 8, 8, 8]]


@pytest.fixture(scope="module")
def fixtures():
    return load_fixtures(FIXTURES, NAMES)


def _copy(tmp_path, name="pattern6_tied"):
    return _copy_fixture(tmp_path, name, FIXTURES)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_hidden_states_match_transformers(fixtures, name):
    model, ref = fixtures[name]
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < 1e-5
    layers = model.config.num_hidden_layers
    hidden = model.hidden_states(ref["input_ids"], layers=range(layers - 1))
    for i in range(layers - 1):  # transformers' entry i+1: the output of layer i (the last after the norm)
        assert rel_err(hidden.layers[i], ref["hidden_states"][i + 1]) < 1e-5, i
    assert rel_err(hidden.post_norm, ref["hidden_states"][layers]) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(fixtures, name):
    """Prefill and decoding over the paged cache (pages of 4 positions, windows of 2-4) give
    transformers' tokens, 16 of them past an 8-token prompt."""
    model, ref = fixtures[name]
    prompts, n, want = greedy_reference(ref)
    assert model.generate(prompts, max_new_tokens=n, ignore_eos=True).tokens == want


@pytest.mark.parametrize("name", ["pattern6_tied", "mixed_softcap_linear_untied"])
def test_paged_logits_match_transformers_token_by_token(fixtures, name):
    """The paged cache's windowed attention itself, at every position of the reference rows:
    prefill of 9 tokens, then 3 calls of 3 tokens (verification's shape), then one token at a
    time, over pages of 2 scattered in the pool: each call's logits are transformers' (the window is
    3-4 tokens, so almost every query's window starts inside an earlier call's pages)."""
    from mtp_jax.step import forward_paged_jit

    model, ref = fixtures[name]
    from mtp_jax.targets import target_for

    cfg = model.config
    target = target_for(cfg)
    ids = jnp.asarray(ref["input_ids"])
    b, t = ids.shape
    page, per_row = 2, t // 2
    pages = target.init_cache(cfg, b * per_row + 3, page, jnp.float32)
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.permutation(b * per_row + 3)[: b * per_row].reshape(b, per_row), jnp.int32)
    cuts = [0, 9, 12, 15, 18] + list(range(19, t + 1))
    got = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (b, hi - lo))
        _, logits, pages = forward_paged_jit(
            model.params, pages, cfg, page, ids[:, lo:hi], pos, jnp.ones((b, hi - lo), bool), table
        )
        got.append(np.asarray(logits))
    assert rel_err(np.concatenate(got, axis=1), ref["logits"]) < 1e-5


def test_small_pages_chunked_prefill_and_the_prefix_cache_keep_the_window(fixtures):
    """Pages of 2 positions (each window spans pages), prompts prefilled in chunks of 16 behind a
    cached prefix, and n-gram speculation: the tokens of plain decoding, whose first one is
    transformers' argmax after each 24-token reference row."""
    model, ref = fixtures["pattern6_tied"]
    small = mtp_jax.load(os.path.join(FIXTURES, "pattern6_tied"), "float32", page_size=2)
    rows = [list(map(int, r)) for r in ref["input_ids"]]
    prompts = [rows[0], rows[1], rows[0] + rows[1] + [7, 7], rows[0] + rows[1] + [9]]
    want = model.generate(prompts, max_new_tokens=24, ignore_eos=True).tokens
    assert [w[0] for w in want[:2]] == np.argmax(ref["logits"][:, -1], -1).tolist()
    spec = mtp_jax.SpeculativeConfig(draft="ngram", num_speculative_tokens=3)
    with mtp_jax.Engine(small, speculative=spec, slots=2, max_len=96, chunked_prefill_size=16) as engine:
        got = [
            list(engine.submit(p, max_new_tokens=24, ignore_eos=True).result(timeout=300).tokens)
            for p in prompts
        ]
        stats = engine.stats()
    assert got == want
    assert_speculated(stats)
    assert stats["prefix_cache_hits"] > 0 and stats["prefill_chunks"] > 0


def test_the_window_and_the_soft_cap_change_the_answer(fixtures):
    """The fixtures can tell: without the window (every layer global) or without the cap, the
    logits move far past the parity tolerance."""
    import dataclasses

    from mtp_jax.scoring import _teacher_forced

    for name, change in (
        ("pattern6_tied", {"layer_types": ("full_attention",) * 12}),
        ("mixed_softcap_linear_untied", {"final_logit_softcapping": None}),
        ("mixed_softcap_linear_untied", {"rope_linear_factor": 1.0}),
    ):
        model, ref = fixtures[name]
        cfg = dataclasses.replace(model.config, **change)
        logits, _ = _teacher_forced(model.params, cfg, jnp.asarray(ref["input_ids"]), ())
        assert rel_err(logits, ref["logits"]) > 1e-3, (name, change)


def test_the_config_is_read_as_transformers_reads_it(fixtures):
    from mtp_jax.targets import target_for
    from mtp_jax.targets.gemma3.config import Gemma3Config

    cfg = fixtures["pattern6_tied"][0].config
    assert isinstance(cfg, Gemma3Config) and target_for(cfg).name == "gemma3"
    assert [i for i, s in enumerate(cfg.sliding) if not s] == [5, 11]
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.softmax_scale) == (1e6, 1e4, 24**-0.5)
    mixed = fixtures["mixed_softcap_linear_untied"][0]
    assert mixed.config.sliding == (True, False, True) and mixed.config.rope_linear_factor == 8.0
    assert mixed.config.final_logit_softcapping == 3.0 and "lm_head" in mixed.params
    assert not any(fixtures["all_global_pattern1"][0].config.sliding)
    layers = fixtures["pattern6_tied"][0].params["layers"]
    assert set(layers) == {"input_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm", "attn", "mlp"}
    assert set(layers["attn"]) == {"q", "k", "v", "o", "q_norm", "k_norm"}


@pytest.mark.parametrize("name", ["pattern6_tied", "mixed_softcap_linear_untied"])
def test_speculation_is_lossless_across_the_window(fixtures, name, tmp_path):
    """Verification of several tokens per row (each its own window) through the paged cache: the
    n-gram draft accepts on the repeating prompts; foreign EAGLE-3 and DFlash drafts plug in."""
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts.dflash.config import DFlashConfig
    from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
    from tests.drafts.test_dflash import DRAFT_A as DFLASH
    from tests.drafts.test_eagle3 import DRAFT_A as EAGLE3
    from tests.drafts.test_eagle3 import draft_tensors

    model, _ = fixtures[name]
    # 24 tokens: the random models fall into loops the n-gram lookup then proposes from
    plain = model.generate(PROMPTS, max_new_tokens=24, ignore_eos=True, max_batch=3).tokens
    ngram = check_lossless(model, "ngram", PROMPTS, (1, 4), plain, max_new_tokens=24)
    assert ngram[1].stats["acceptance_length"] > 1.0
    write_hub_checkpoint(tmp_path / "eagle3", EAGLE3, draft_tensors(EAGLE3))
    write_hub_checkpoint(
        tmp_path / "dflash", DFLASH, dflash_hub_tensors(DFlashConfig.from_dict(DFLASH), 2, seed=4, std=0.2)
    )
    path = os.path.join(FIXTURES, name)
    for draft in ("eagle3", "dflash"):
        drafted = mtp_jax.load(path, "float32", strict=True, draft_model=str(tmp_path / draft))
        why = "a random draft of another target's fixtures"
        check_lossless(drafted, draft, PROMPTS, (1, 3), plain, max_new_tokens=24, unaccepted=why)


def test_token_trees_inside_the_window_are_lossless_and_wider_ones_refused(fixtures):
    """A token tree's nodes see their ancestors only if the whole tree fits the window (4 here).
    The model drafts for itself (a draft model that is the target: every node it proposes is the
    target's own choice, so deep nodes are verified): trees of 3 drafted nodes and their root give
    plain decoding's tokens with every node accepted along the chain; 4 nodes are refused by name."""
    model, _ = fixtures["pattern6_tied"]
    path = os.path.join(FIXTURES, "pattern6_tied")
    drafted = mtp_jax.load(path, "float32", strict=True, draft_model=path)
    kw = dict(max_new_tokens=10, ignore_eos=True, draft="draft_model")
    plain = model.generate(PROMPTS, max_new_tokens=10, ignore_eos=True).tokens
    chain = drafted.generate(PROMPTS, speculative_tree={"depth": 3, "topk": 1, "nodes": 3}, **kw)
    assert chain.tokens == plain and chain.stats["acceptance_length"] > 3.5
    wide = drafted.generate(PROMPTS, speculative_tree={"depth": 2, "topk": 2, "nodes": 3}, **kw)
    assert wide.tokens == plain and wide.stats["acceptance_length"] > 2.5
    with pytest.raises(ValueError, match="a token tree of 4 drafted nodes .* sliding window of 4 positions"):
        drafted.generate(PROMPTS, speculative_tree={"depth": 2, "topk": 2, "nodes": 4}, **kw)


def test_a_soft_capped_draft_model_drafts_from_its_capped_logits(fixtures):
    """The soft-capped model as its own draft model, drafts drawn from the draft's distribution at
    temperature 1: the draft's q is the target's p exactly, so every draft is accepted (u q <= p
    always); drafting from uncapped logits (q != p) rejects some."""
    path = os.path.join(FIXTURES, "mixed_softcap_linear_untied")
    drafted = mtp_jax.load(path, "float32", strict=True, draft_model=path)
    out = drafted.generate(
        PROMPTS,
        max_new_tokens=16,
        ignore_eos=True,
        draft="draft_model",
        num_speculative_tokens=3,
        draft_sampling="sampled",
        temperature=1.0,
        seed=[1, 2, 3, 4],
    )
    stats = out.stats
    assert stats["num_draft_tokens"] > 40 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]


@pytest.mark.parametrize("name", ["pattern6_tied", "mixed_softcap_linear_untied"])
def test_plan_estimate_and_export_follow_the_declared_tree(fixtures, name):
    from mtp_jax.estimate import count_parameters
    from mtp_jax.export import hub_tensors_from_params
    from mtp_jax.plan import abstract_params
    from mtp_jax.sharding import make_mesh

    model, _ = fixtures[name]
    reader = CheckpointReader(os.path.join(FIXTURES, name))
    stored = {k: np.asarray(reader.get(k), np.float32) for k in reader.keys()}
    back = hub_tensors_from_params(model.params, model.config)
    assert sorted(back) == sorted(stored)
    for key, x in stored.items():
        np.testing.assert_array_equal(back[key], x, err_msg=key)
    assert count_parameters(model.config).total == sum(x.size for x in stored.values())
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    abstract = abstract_params(model.config, mesh, jnp.float32, weights="bf16")
    assert jax.tree.structure(abstract) == jax.tree.structure(model.params)


def test_visible_keys_slide_by_sequence_position_even_in_a_tree():
    """The window mask on its own: a plain query sees its last ``size`` positions; a tree node
    (cache position past its sequence position) is measured from its sequence position, and sees
    its ancestors inside the tree."""
    from pallas_kernels.paged import visible_keys

    keys = jnp.arange(10)
    plain = visible_keys(keys, jnp.asarray([[6]]), window=(jnp.int32(3), None))
    assert np.flatnonzero(np.asarray(plain[0, 0])).tolist() == [4, 5, 6]
    # a tree at cache positions 6.. : node 2 (cache 8) is a child of node 0 (cache 6), depth 1,
    # so its sequence position is 7 and it sees prefix keys 5 (7 - 3 + 1) .. 5, then nodes 0 and 2
    nodes = jnp.asarray([[[1, 0, 1]]], bool)
    tree = visible_keys(
        keys, jnp.asarray([[8]]), (jnp.asarray([6]), nodes), (jnp.int32(3), jnp.asarray([[7]]))
    )
    assert np.flatnonzero(np.asarray(tree[0, 0])).tolist() == [5, 6, 8]


def write_gemma3_gguf(src: str, path: str, drop: str | None = None) -> str:
    """A hub Gemma 3 checkpoint as llama.cpp's converter writes it: ``gemma3.*`` metadata, its tensor
    names, every norm stored as 1 + w (``drop``: a GGUF tensor left out)."""
    import json

    gguf = pytest.importorskip("gguf")
    from mtp_jax.targets.gemma3.gguf import GLOBAL_NAMES, LAYER_NAMES

    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    to_gguf = {hub: name for name, hub in GLOBAL_NAMES.items()}
    to_gguf.update(
        {f"model.layers.{i}.{hub}": f"blk.{i}.{name}" for name, hub in LAYER_NAMES.items() for i in range(99)}
    )
    reader = CheckpointReader(src)
    for key in reader.keys():
        x = np.asarray(reader.get(key), np.float32)
        name = to_gguf[key]
        if name != drop:
            w.add_tensor(name, x + 1.0 if key.endswith("norm.weight") else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gemma3_gguf_reads_as_its_hub_checkpoint(fixtures, tmp_path):
    """The GGUF layout: llama.cpp's names (its ffn_norm is the norm before the MLP), norms stored
    1 + w, the pattern and the local rope base llama.cpp fixes, the window from the metadata;
    scores scaled by 1/sqrt(head_dim) (llama.cpp has no query_pre_attn_scalar); a missing tensor
    named."""
    import dataclasses

    from mtp_jax.scoring import _teacher_forced

    hub, ref = fixtures["pattern6_tied"]
    src = os.path.join(FIXTURES, "pattern6_tied")
    model = mtp_jax.load(write_gemma3_gguf(src, str(tmp_path / "g.gguf")), "float32", strict=True)
    assert np.float32(model.config.rms_norm_eps) == np.float32(hub.config.rms_norm_eps)  # stored float32
    eps = model.config.rms_norm_eps
    same = dict(query_pre_attn_scalar=16.0, eos_token_ids=(), bos_token_id=None, rms_norm_eps=eps)
    assert model.config == dataclasses.replace(hub.config, **same)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(hub.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    want, _ = _teacher_forced(hub.params, model.config, jnp.asarray(ref["input_ids"]), ())
    np.testing.assert_allclose(model.logits(ref["input_ids"]), want, rtol=1e-5, atol=1e-5)
    broken = write_gemma3_gguf(src, str(tmp_path / "b.gguf"), drop="blk.3.post_ffw_norm.weight")
    with pytest.raises(
        mtp_jax.CheckpointError, match=r"model\.layers\.3\.post_feedforward_layernorm\.weight"
    ):
        mtp_jax.load(broken, "float32")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
        (
            {"layer_types": ["sliding_attention"] * 11 + ["chunked_attention"]},
            r"layer_types\[11\] = 'chunked_attention'",
        ),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list one type per layer"),
        ({"sliding_window": None}, "sliding_window must be a positive integer when layers slide"),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "rope_type 'yarn'"),
        ({"model_type": "gemma2"}, "unsupported model_type 'gemma2'"),
    ],
)
def test_unsupported_variants_are_refused_by_name(tmp_path, changes, message):
    path = _copy(tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(mtp_jax.ConfigError, match=message):
        mtp_jax.load(path, "float32")


def test_a_missing_tensor_is_named(tmp_path):
    path = _copy(tmp_path)
    key = "model.layers.4.post_feedforward_layernorm.weight"
    reader = CheckpointReader(str(path))
    tensors = {k: reader.get(k) for k in reader.keys() if k != key}
    save_safetensors(str(path / "model.safetensors"), tensors, {"format": "pt"})
    with pytest.raises(mtp_jax.CheckpointError, match=key.replace(".", r"\.")):
        mtp_jax.load(path, "float32")


# --- window_cache="ring": the sliding-window layers keep each slot's window, not every page ---

LONG = [[int(x) for x in np.random.default_rng(1).integers(1, 120, n)] for n in (150, 40, 97, 5)]
"""Prompts past the ring (70 positions at pages of 2 and a window of 4: the window and a 64-token
chunk), so every later chunk and step writes over pages the window no longer reads."""


def _same_logprobs(got: list, want: list) -> None:
    """Rows of TokenLogprobs equal but for float rounding (top tokens and their log-probabilities):
    the tiny models are too sure of themselves for their tokens alone to show a wrong key."""
    for row_got, row_want in zip(got, want, strict=True):
        for a, b in zip(row_got, row_want, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose([lp for _, lp in a.top], [lp for _, lp in b.top], rtol=1e-4, atol=1e-4)


def test_a_ring_holds_the_window_and_decodes_as_every_page_does(fixtures):
    """Greedy and sampled rows, prompts prefilled in chunks of 64 across the ring and decoded past
    it, and n-gram speculation: the same tokens as the cache of every page (itself transformers'),
    from a cache whose local layers hold 2 x 35 pages per slot instead of every page."""
    from mtp_jax.cache import ring_pages
    from mtp_jax.step import StepConfig, init_state

    path = os.path.join(FIXTURES, "pattern6_tied")
    pages = mtp_jax.load(path, "float32", page_size=2)
    ring = mtp_jax.load(path, "float32", page_size=2, window_cache="ring")
    kw = dict(max_new_tokens=40, ignore_eos=True)
    want = pages.generate(LONG, logprobs=5, **kw)
    got = ring.generate(LONG, logprobs=5, **kw)
    assert got.tokens == want.tokens
    _same_logprobs(got.logprobs, want.logprobs)
    want = want.tokens
    sampled = dict(kw, temperature=[1.0, 0.7, 1.0, 0.0], seed=[1, 2, 3, 4], top_k=[0, 20, 0, 0])
    assert ring.generate(LONG, **sampled).tokens == pages.generate(LONG, **sampled).tokens
    spec = ring.generate(LONG, draft="ngram", num_speculative_tokens=4, **kw)
    assert spec.tokens == want
    assert_speculated(spec.stats)

    cfg = ring.config  # 10 local layers (window 4), 2 global
    sc = dataclasses.replace(StepConfig(cfg, 2), local_ring=ring_pages(4, 2, 64))
    assert sc.local_ring == 35
    state = init_state(sc, 4, 4 * 128, 128, jnp.float32)
    shapes = {name: leaf.shape for name, leaf in state.target_pages.items()}
    assert shapes == {
        "k": (2, 4 * 128, 2, 1, 16),
        "v": (2, 4 * 128, 2, 1, 16),
        "ring_k": (10, 4 * 35, 2, 1, 16),
        "ring_v": (10, 4 * 35, 2, 1, 16),
    }


def test_a_ring_serves_chunked_prompts_chains_and_trees(fixtures):
    """Through the serving engine (prompts arriving 32 tokens a call, rows bucketed, cached prefixes
    whose last window the ring computes again, in one prefill and in chunks) and with the model as
    its own draft (static and dynamic trees whose accepted paths the step moves inside the ring):
    plain decoding's tokens and log-probabilities."""
    path = os.path.join(FIXTURES, "mixed_softcap_linear_untied")
    kw = dict(max_new_tokens=30, ignore_eos=True, logprobs=5)
    rng = np.random.default_rng(2)
    again = [LONG[0][:120] + [int(x) for x in rng.integers(1, 120, 20)], LONG[0][:100] + LONG[2][:60]]
    want = mtp_jax.load(path, "float32", page_size=2).generate(LONG + again, **kw)
    ring = mtp_jax.load(path, "float32", page_size=2, window_cache="ring", draft_model=path)
    with mtp_jax.Engine(ring, slots=4, max_len=256, chunked_prefill_size=32) as engine:
        done = [h.result(600) for h in [engine.submit(p, **kw) for p in LONG]]
        done += [h.result(600) for h in [engine.submit(p, **kw) for p in again]]
        assert [c.tokens for c in done] == want.tokens
        _same_logprobs([c.logprobs for c in done], want.logprobs)
        stats = engine.stats()
        assert stats["prefill_chunks"] > 0 and stats["prefix_cache_hits"] >= 200, stats
    path = os.path.join(FIXTURES, "pattern6_tied")  # a window of 4: trees of 3 drafted nodes
    pages = mtp_jax.load(path, "float32", page_size=2, draft_model=path)
    ring = mtp_jax.load(path, "float32", page_size=2, window_cache="ring", draft_model=path)
    want = pages.generate(LONG, max_new_tokens=30, ignore_eos=True).tokens
    kw = dict(max_new_tokens=30, ignore_eos=True, draft="draft_model")
    wide = {"depth": 2, "topk": 2, "nodes": 3}
    for tree in (wide, {**wide, "dynamic": True}):  # chains: the n-gram's above
        out = ring.generate(LONG, speculative_tree=tree, **kw)
        assert out.tokens == want, tree
        assert out.stats["acceptance_length"] > 2.5, (tree, out.stats)
    # rows sampled at temperature 3 often take the second child's path: its keys are moved inside the
    # ring (the first child is the chain, consecutive already; without the move this differs)
    sampled = dict(kw, speculative_tree=wide, temperature=3.0, seed=[5, 6, 7, 8])
    assert ring.generate(LONG, **sampled).tokens == pages.generate(LONG, **sampled).tokens


RING_MESH_CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    assert len(jax.devices()) == 8
    import mtp_jax
    from tests.targets.test_gemma3 import LONG, _same_logprobs

    path = sys.argv[1]
    mesh = mtp_jax.make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
    one = mtp_jax.load(path, "float32", page_size=2, draft_model=path)
    ring = mtp_jax.load(path, "float32", page_size=2, draft_model=path, window_cache="ring", mesh=mesh)
    kw = dict(max_new_tokens=24, ignore_eos=True)
    want = one.generate(LONG, logprobs=5, **kw)
    got = ring.generate(LONG, logprobs=5, **kw)
    assert got.tokens == want.tokens
    _same_logprobs(got.logprobs, want.logprobs)
    spec = ring.generate(LONG, draft="ngram", num_speculative_tokens=4, **kw)
    assert spec.tokens == want.tokens and spec.stats["num_accepted_tokens"] > 0
    # a token tree whose sampled rows take second children: accepted paths moved inside sharded rings
    tree = dict(kw, draft="draft_model", speculative_tree={"depth": 2, "topk": 2, "nodes": 3})
    tree.update(temperature=3.0, seed=[5, 6, 7, 8])
    assert ring.generate(LONG, **tree).tokens == one.generate(LONG, **tree).tokens
    # the serving engine: prompts in chunks of 32, cached prefixes whose last window is recomputed
    # into the slot's ring on its own devices
    again = [LONG[0][:120] + LONG[3], LONG[0][:100] + LONG[2][:60]]
    want = one.generate(LONG + again, **kw).tokens
    with mtp_jax.Engine(ring, slots=4, max_len=256, chunked_prefill_size=32) as engine:
        done = [h.result(600) for h in [engine.submit(p, **kw) for p in LONG]]
        done += [h.result(600) for h in [engine.submit(p, **kw) for p in again]]
        stats = engine.stats()
    assert [c.tokens for c in done] == want
    # a hit reuses pages of its own shard only: one of the two here (the slots alternate shards)
    assert stats["prefill_chunks"] > 0 and stats["prefix_cache_hits"] >= 100, stats
    # each data shard holds its own slots' rings (no collective needed to attend)
    from mtp_jax.request import SpeculativeConfig, step_config
    from mtp_jax.sharding import state_shardings
    from mtp_jax.step import init_state
    sc = step_config(ring, SpeculativeConfig())
    state = init_state(sc, 4, 4 * 128, 128, np.float32)
    state = jax.device_put(state, state_shardings(sc, state))
    leaf = state.target_pages["ring_k"]
    assert tuple(leaf.sharding.spec)[1] == "data", leaf.sharding.spec
    assert leaf.addressable_shards[0].data.shape[1] == 2 * sc.local_ring == leaf.shape[1] // 2
    print("RING-MESH-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(RING_MESH_CHILD, os.path.join(FIXTURES, "pattern6_tied"))
def test_a_ring_on_a_mesh_decodes_as_one_device_does(child_output):
    """Rows and their rings split over data = 2, heads over tensor = 2 (one KV head, replicated):
    greedy rows with log-probabilities, n-gram chains, sampled token trees and the serving engine's
    chunked prompts and prefix hits give one device's every-page tokens; each shard holds its own
    slots' rings."""
    assert "RING-MESH-OK" in child_output


def test_a_ring_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="window_cache must be one of"):
        mtp_jax.load(os.path.join(FIXTURES, "pattern6_tied"), "float32", window_cache="window")
    with pytest.raises(ValueError, match="has no sliding-window layers"):
        mtp_jax.load(os.path.join(FIXTURES, "all_global_pattern1"), "float32", window_cache="ring")
    with pytest.raises(ValueError, match="has no sliding-window layers"):
        mtp_jax.load(os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib"), "float32", window_cache="ring")


def test_a_ring_warms_up_the_programs_its_requests_run():
    """The warm-up compiles the ring's prefill and chunk programs (they take the cached prefix's
    end): a prompt in chunks and one hitting its prefix then compile nothing new."""
    from mtp_jax.request import SpeculativeConfig, step_config
    from mtp_jax.sampling import RowSampling
    from mtp_jax.scheduler import Request, Scheduler, pages_needed
    from mtp_jax.step import prefill, prefill_chunk

    ring = mtp_jax.load(os.path.join(FIXTURES, "pattern6_tied"), "float32", page_size=2, window_cache="ring")
    sc = step_config(ring, SpeculativeConfig())
    sched = Scheduler(
        ring.params, sc, slots=2, width=pages_needed(128, 0, sc), eos_token_ids=(),
        cache_dtype=jnp.float32, chunked_prefill=32, prefix_caching=True,
    )  # fmt: skip
    sched.warmup(64, [0])
    sizes = prefill._cache_size(), prefill_chunk._cache_size()
    first = sched.submit(Request(LONG[1], 4, RowSampling.build(1)))
    while sched.advance():
        pass
    second = sched.submit(Request(LONG[1][:30] + LONG[3], 4, RowSampling.build(1)))
    while sched.advance():
        pass
    assert len(first.tokens) == len(second.tokens) == 4 and sched.prefix.hits == 30
    assert sched.counts["prefill_chunks"] == 1
    assert (prefill._cache_size(), prefill_chunk._cache_size()) == sizes
