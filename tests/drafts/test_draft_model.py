"""A separate draft model (mtp_jax/drafts/draft_model/draft.py): the target as its own draft accepts every
draft (greedy, and sampled drafts whose q is the target's p); other draft models (another family,
random weights) are lossless with per-request K; teacher-forced logits are the draft's own; the
recognition and refusals of its loader; sharded == one device; plan and the roofline count it. Its
exactness under sampling is in tests/test_acceptance.py."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from mtp_jax.request import SpeculativeConfig, step_config
from mtp_jax.targets.llama.config import Llama3Config
from mtp_jax.targets.llama.synthetic import llama_hub_tensors
from tests.conftest import EMBEDDED_MODEL, REPO, assert_speculated, check_lossless, check_per_request_k

LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
PROMPTS = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [100], [8, 8, 8, 8, 8, 8, 8]]
# A random two-layer Llama over the shipped tiny models' vocabulary (2048 tokens).
SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("draft-model") / "small"
    write_hub_checkpoint(path, SMALL, llama_hub_tensors(Llama3Config.from_dict(SMALL), seed=3, embed_std=0.5))
    return str(path)


@pytest.fixture(scope="module")
def oracle() -> mtp_jax.Model:
    """The tiny Llama with itself as its draft model."""
    return mtp_jax.load(LLAMA, "float32", draft_model=LLAMA)


def test_the_target_as_its_own_draft_accepts_every_draft(oracle):
    assert oracle.drafts == ("draft_model",) and oracle.default_draft == "draft_model"
    plain = oracle.generate(PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3)
    for k, out in zip(
        (1, 4), check_lossless(oracle, "draft_model", PROMPTS, (1, 4), plain.tokens), strict=True
    ):
        assert out.stats["acceptance_rate_per_position"] == [1.0] * k, k
    check_per_request_k(oracle, "draft_model", PROMPTS, plain.tokens)
    # sampled drafts from the target's own processed distribution: q == p, every draft accepted
    sampled = oracle.generate(
        PROMPTS,
        max_new_tokens=12,
        ignore_eos=True,
        max_batch=3,
        draft="draft_model",
        num_speculative_tokens=3,
        draft_sampling="sampled",
        temperature=0.8,
        top_p=0.9,
        seed=[1, 2, 3, 4],
    )
    assert sampled.stats["acceptance_rate_per_position"] == [1.0] * 3


def test_teacher_forced_logits_are_the_draft_models_own(oracle):
    from mtp_jax.drafts import draft_for

    ids = np.asarray([PROMPTS[1]], np.int32)
    sc = step_config(oracle, SpeculativeConfig("draft_model", 2))
    got = draft_for("draft_model").teacher_forced(oracle.params, sc, jnp.asarray(ids), None)
    np.testing.assert_allclose(np.asarray(got), oracle.logits(ids)[:, 1:], rtol=1e-5, atol=1e-5)


def test_another_family_and_a_random_draft_are_lossless(small_draft):
    """The shipped tiny DeepSeek-V3 (MLA, MoE) drafted by the shipped tiny Llama (same tokenizer,
    trained on the same text: it accepts), and the tiny Llama drafted by a random two-layer Llama."""
    for target, draft, accepts in ((EMBEDDED_MODEL, LLAMA, True), (LLAMA, small_draft, False)):
        model = mtp_jax.load(target, "float32", draft_model=draft)
        plain = model.generate(PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3)
        for out in check_lossless(model, "draft_model", PROMPTS, (1, 3), plain.tokens):
            if accepts:
                assert out.stats["acceptance_length"] > 1.3, out.stats
        check_per_request_k(model, "draft_model", PROMPTS, plain.tokens)


def test_a_smaller_draft_vocabulary_is_never_proposed_past_its_end(tmp_path):
    """A draft model over the first 2000 ids of a 2048-token target: logits -inf beyond."""
    from mtp_jax.drafts import draft_for

    raw = {**SMALL, "vocab_size": 2000}
    write_hub_checkpoint(tmp_path / "d", raw, llama_hub_tensors(Llama3Config.from_dict(raw), seed=4))
    model = mtp_jax.load(LLAMA, "float32", draft_model=str(tmp_path / "d"))
    sc = step_config(model, SpeculativeConfig("draft_model", 2))
    logits = np.asarray(
        draft_for("draft_model").teacher_forced(model.params, sc, jnp.asarray([PROMPTS[1]]), None)
    )
    assert (
        logits.shape[-1] == 2048
        and np.all(np.isneginf(logits[..., 2000:]))
        and np.isfinite(logits[..., :2000]).all()
    )
    plain = model.generate(PROMPTS, max_new_tokens=8, ignore_eos=True, max_batch=3)
    out = model.generate(PROMPTS, max_new_tokens=8, ignore_eos=True, max_batch=3, draft="draft_model")
    assert out.tokens == plain.tokens
    assert_speculated(out.stats)


def test_what_is_not_a_draft_model_is_refused_by_name(tmp_path, small_draft):
    raw = {**SMALL, "vocab_size": 4096}
    write_hub_checkpoint(tmp_path / "big", raw, llama_hub_tensors(Llama3Config.from_dict(raw), seed=4))
    with pytest.raises(mtp_jax.ConfigError, match="draft model's vocab_size is 4096, the target's 2048"):
        mtp_jax.load(LLAMA, "float32", draft_model=str(tmp_path / "big"))
    other = tmp_path / "other-tokenizer"
    shutil.copytree(small_draft, other)
    with open(os.path.join(LLAMA, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab["zz-not-in-the-target"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(mtp_jax.ConfigError, match="tokenizer vocabulary differs from the target's"):
        mtp_jax.load(LLAMA, "float32", draft_model=str(other))
    odd = tmp_path / "odd"
    shutil.copytree(small_draft, odd)
    (odd / "config.json").write_text(
        json.dumps({**SMALL, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(
        mtp_jax.ConfigError, match=r"not a supported draft model \(architectures \['GPT2LMHeadModel'\]"
    ):
        mtp_jax.load(LLAMA, "float32", draft_model=str(odd))
    with pytest.raises(mtp_jax.InvalidRequestError, match="needs a draft model loaded"):
        mtp_jax.load(LLAMA, "float32").generate([[1, 2]], draft="draft_model")


def test_plan_and_the_roofline_count_the_draft_model(oracle):
    from mtp_jax.plan import abstract_params
    from mtp_jax.roofline import step_bytes
    from mtp_jax.sharding import make_mesh

    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    abstract = abstract_params(
        oracle.config, mesh, jnp.float32, weights="bf16", draft_cfg=oracle.draft_config
    )
    real = {k: oracle.params[k] for k in abstract}
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real), strict=True):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)
    kw = dict(batch=1, context=64, cache_itemsize=4, draft_cfg=oracle.draft_config)
    plain = step_bytes(oracle.params, oracle.config, k=0, **kw)
    spec = step_bytes(oracle.params, oracle.config, k=3, **kw)
    assert plain.draft_weights == plain.draft_heads == 0
    # three passes over every draft weight but its embedding, of which the rows its 5 + 2 tokens read
    tree = oracle.params["draft_model"]
    own, embed = sum(x.nbytes for x in jax.tree.leaves(tree)), tree["embed"].nbytes
    want = 3 * (own - embed) + embed * 7 / tree["embed"].shape[0]
    assert spec.draft_weights + spec.draft_heads == pytest.approx(want), (spec, want)
    assert spec.kv > 2 * plain.kv  # its own cache, as big as the target's, read by every pass


SHARDED_CHILD = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    assert len(jax.devices()) == 8
    import mtp_jax
    from tests.conftest import EMBEDDED_MODEL
    from tests.drafts.test_draft_model import LLAMA

    prompts = [[5, 9, 17, 3, 5, 9], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77], [10], [8, 8, 8, 8, 8, 8], [3, 1]]
    spec = dict(max_new_tokens=10, ignore_eos=True, draft="draft_model", num_speculative_tokens=3)
    sampled = dict(spec, temperature=0.9, top_k=20, seed=[1, 2, 3, 4, 5])
    for target, axes in [(LLAMA, dict(data=4, tensor=2)), (EMBEDDED_MODEL, dict(data=2, expert=4))]:
        one = mtp_jax.load(target, "float32", page_size=4, draft_model=LLAMA)
        mesh = mtp_jax.make_mesh(**axes)
        model = mtp_jax.load(target, "float32", page_size=4, draft_model=LLAMA, mesh=mesh)
        for how, kw in (("argmax", spec), ("sampled", sampled)):
            want = one.generate(prompts, draft_sampling=how, **kw)
            out = model.generate(prompts, draft_sampling=how, **kw)
            assert out.tokens == want.tokens, (target, axes, how)
            assert out.stats["acceptance_length"] > 1.0, (target, axes, how)
    print("DRAFT-MODEL-SHARDED-OK")
    """
)


@pytest.mark.child(SHARDED_CHILD)
def test_sharded_like_one_device(child_output):
    assert "DRAFT-MODEL-SHARDED-OK" in child_output


def test_the_cli_recognises_a_draft_model(capsys):
    """``--draft-model DIR`` with a plain language model: ``--draft auto`` picks it, and the text
    is plain decoding's."""
    from mtp_jax.cli import main

    base = ["generate", "--model", EMBEDDED_MODEL, "--prompt", "def fibonacci(n):", "--max-new-tokens", "12"]
    assert main([*base, "--draft", "none"]) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--draft-model", LLAMA, "-k", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "acceptance length" in err
    assert main([*base, "--draft-model", LLAMA, "--draft", "draft_model", "-k", "2"]) == 0
    assert capsys.readouterr().out == plain


def test_a_published_model_plans_as_another_ones_draft_model():
    """``mtp-jax plan --draft-config`` with a plain causal LM's config: Llama 3.1 8B drafting for
    70B (same vocabulary) passes the plan's checks; for DeepSeek-V3 (another vocabulary) it does not."""
    from mtp_jax.config import load_config, read_json
    from mtp_jax.drafts import parse_draft_config
    from mtp_jax.drafts.draft_model.config import DraftModelConfig
    from mtp_jax.plan import check_plan

    raw = read_json(os.path.join(REPO, "configs", "llama-3.1-8b.json"), what="config")
    for target, ok in (("llama-3.1-70b.json", True), ("deepseek-v3.json", False)):
        cfg = load_config(os.path.join(REPO, "configs", target))
        draft = parse_draft_config(raw, cfg.num_hidden_layers, target_vocab_size=cfg.vocab_size)
        assert isinstance(draft, DraftModelConfig) and draft.model.num_hidden_layers == 32
        args = (cfg, {"tensor": 8} if ok else {"expert": 8}, 8, 4096, 16, 4, "bf16", 0)
        if ok:
            check_plan(*args, draft_cfg=draft)
        else:
            with pytest.raises(ValueError, match="draft model's vocab_size is 128256, the target's 129280"):
                check_plan(*args, draft_cfg=draft)


@pytest.mark.parametrize("target", [LLAMA, EMBEDDED_MODEL], ids=["llama", "deepseek"])
def test_the_shipped_draft_model_is_lossless_and_accepted_on_both_targets(target):
    """checkpoints/tiny-llama3-stdlib-draft (scripts/train_tiny.py --arch llama --preset draft) on
    the targets' held-out prompts (those their EAGLE-3 cards measured): plain decoding's tokens,
    and accepted as BENCHMARKS.md reports it (about 2.2 at K = 3)."""
    from tokenizers import Tokenizer

    draft = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib-draft")
    with open(f"{target}-eagle3/eval.json", encoding="utf-8") as f:
        texts = json.load(f)["prompts"][:8]
    tok = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in texts]
    model = mtp_jax.load(target, "float32", strict=True, draft_model=draft)
    plain = model.generate(prompts, max_new_tokens=48, max_batch=8).tokens
    (k1, k3) = check_lossless(model, "draft_model", prompts, (1, 3), plain, max_new_tokens=48, max_batch=8)
    assert k3.stats["acceptance_length"] > 2.0, k3.stats
    rates = k3.stats["acceptance_rate_per_position"]
    assert 1.0 > rates[0] > rates[1] > rates[2] > 0.0, rates
