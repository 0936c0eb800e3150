"""EAGLE-3 drafts: the draft forward against an independent float64 reference of the published math
(docs/formats.md, "EAGLE-3 drafts") on transformers' own hidden states, the three key dialects, the
errors a bad draft gets, and speculative generation with it on both targets."""

from __future__ import annotations

import copy
import functools
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from mtp_jax.drafts.eagle3.config import Eagle3Config, eagle3_capture, parse_eagle3_config
from mtp_jax.drafts.eagle3.synthetic import eagle3_hub_tensors
from mtp_jax.errors import CheckpointError, ConfigError
from mtp_jax.targets.base import PagedAttention
from tests.conftest import REPO, assert_speculated, check_per_request_k

TARGET = os.path.join(REPO, "tests", "fixtures", "parity_llama", "llama3_gqa42")  # L = 3, d = 32, V = 128
REF = dict(np.load(os.path.join(TARGET, "reference.npz")))  # transformers' hidden_states [L + 1, b, T, d]

# A GQA draft with a 48-token draft vocabulary, its own llama3-scaled rope, ids read as layer inputs.
DRAFT_A = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "num_hidden_layers": 1,
    "vocab_size": 128,
    "draft_vocab_size": 48,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "max_position_embeddings": 512,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
}
# A narrower draft (own embedding) with both supported variant flags and the default layers.
DRAFT_B = {
    "architectures": ["Eagle3LlamaForCausalLM"],
    "hidden_size": 24,
    "target_hidden_size": 32,
    "intermediate_size": 40,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "vocab_size": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "norm_before_residual": True,
    "norm_output": True,
}
# An MLA draft (SGLang's Eagle3DeepseekV2ForCausalLM layout) for the DeepSeek-V3 parity fixture
# "base" (d = 48, L = 3, V = 128), with a draft vocabulary and its own plain rope.
DEEPSEEK_TARGET = os.path.join(REPO, "tests", "fixtures", "parity", "base")
DEEPSEEK_REF = dict(np.load(os.path.join(DEEPSEEK_TARGET, "reference.npz")))
DRAFT_MLA = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "q_lora_rank": 12,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "num_hidden_layers": 1,
    "vocab_size": 128,
    "draft_vocab_size": 48,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000.0,
    "max_position_embeddings": 256,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 0]},
}
DRAFT_IDS = np.sort(np.random.default_rng(5).choice(128, 48, replace=False))


def draft_tensors(raw: dict, prefix: str = "midlayer.", seed: int = 1) -> dict:
    cfg = parse_eagle3_config(raw, mla="kv_lora_rank" in raw)
    embed = None
    if cfg.hidden_size != cfg.target_hidden_size:
        embed = np.random.default_rng(seed + 100).standard_normal((128, cfg.hidden_size)).astype(np.float32)
    ids = DRAFT_IDS if cfg.draft_vocab_size < cfg.vocab_size else None
    return eagle3_hub_tensors(cfg, seed, 0.2, layer_prefix=prefix, draft_ids=ids, embed=embed)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict:
    """name -> (draft directory, its tensors, its raw config)."""
    root = tmp_path_factory.mktemp("eagle3")
    out = {}
    # seeds whose random drafts the target sometimes accepts (the lossless tests check they are)
    for name, raw, prefix, seed in (
        ("a_midlayer", DRAFT_A, "midlayer.", 13),
        ("a_layers0", DRAFT_A, "layers.0.", 13),
        ("a_nemo", DRAFT_A, "model.layers.0.", 13),
        ("b", DRAFT_B, "model.layers.0.", 5),
        ("mla", DRAFT_MLA, "layers.0.", 1),
    ):
        tensors = draft_tensors(raw, prefix, seed)
        write_hub_checkpoint(root / name, raw, tensors)
        out[name] = (str(root / name), tensors, raw)
    return out


# --- the independent reference ------------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _inv_freq(raw: dict, head_dim: int) -> np.ndarray:
    """Rotate-half rope frequencies, llama3-scaled as Llama 3.1 publishes the rule."""
    theta = raw.get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rs = raw.get("rope_scaling")
    if not rs:
        return inv
    factor, lo, hi, orig = (
        rs["factor"],
        rs["low_freq_factor"],
        rs["high_freq_factor"],
        rs["original_max_position_embeddings"],
    )
    out = []
    for f in inv:
        wavelen = 2 * np.pi / f
        if wavelen < orig / hi:
            out.append(f)
        elif wavelen > orig / lo:
            out.append(f / factor)
        else:
            s = (orig / wavelen - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return np.asarray(out)


def _rope(x, pos, inv):  # x [b, t, heads, d]
    ang = pos[:, None] * inv[None, :]  # [t, d/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _causal_softmax(scores: np.ndarray) -> np.ndarray:  # [b, h, q, k]
    n = scores.shape[-1]
    scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _gqa_attention(t: dict, raw: dict, u: np.ndarray, a: str, nh: int) -> np.ndarray:
    """Llama attention of u [b, n, 2H]: rotate-half rope with the draft's llama3-scaled frequencies."""
    b, n = u.shape[:2]
    nkv = raw["num_key_value_heads"]
    hd = raw.get("head_dim", raw["hidden_size"] // nh)
    q = (u @ t[a + "q_proj.weight"].T).reshape(b, n, nh, hd)
    k = (u @ t[a + "k_proj.weight"].T).reshape(b, n, nkv, hd)
    v = (u @ t[a + "v_proj.weight"].T).reshape(b, n, nkv, hd)
    pos = np.arange(n, dtype=np.float64)
    inv = _inv_freq(raw, hd)
    q, k = _rope(q, pos, inv), _rope(k, pos, inv)
    k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)
    p = _causal_softmax(np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd))
    return np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, n, nh * hd)


def _mla_attention(t: dict, raw: dict, u: np.ndarray, a: str, nh: int) -> np.ndarray:
    """DeepSeek MLA of u [b, n, 2H], expanded: low-rank q with its norm, one shared rope key from
    kv_a, per-head keys/values up-projected from the normed latent; rope on adjacent pairs
    (DeepSeek's layout), plain frequencies; scale 1/sqrt(nope + rope)."""
    b, n = u.shape[:2]
    nope, rope, vd, kvr = (
        raw["qk_nope_head_dim"],
        raw["qk_rope_head_dim"],
        raw["v_head_dim"],
        raw["kv_lora_rank"],
    )
    eps = raw["rms_norm_eps"]
    q = _rms(u @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"], eps) @ t[a + "q_b_proj.weight"].T
    q = q.reshape(b, n, nh, nope + rope)
    ckv = u @ t[a + "kv_a_proj_with_mqa.weight"].T
    latent = _rms(ckv[..., :kvr], t[a + "kv_a_layernorm.weight"], eps)
    kv = (latent @ t[a + "kv_b_proj.weight"].T).reshape(b, n, nh, nope + vd)
    inv = 1.0 / raw.get("rope_theta", 10000.0) ** (np.arange(0, rope, 2, dtype=np.float64) / rope)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]  # [n, rope/2]

    def rotate_pairs(x):  # x [..., n, (heads,) rope]: pairs (2i, 2i+1) rotated by ang[:, i]
        c, s = np.cos(ang), np.sin(ang)
        if x.ndim == 4:
            c, s = c[:, None, :], s[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
        return out

    q_pe, k_pe = rotate_pairs(q[..., nope:]), rotate_pairs(ckv[..., kvr:])
    scores = np.einsum("bqhd,bkhd->bhqk", q[..., :nope], kv[..., :nope])
    scores = (scores + np.einsum("bqhd,bkd->bhqk", q_pe, k_pe)) / np.sqrt(nope + rope)
    p = _causal_softmax(scores)
    return np.einsum("bhqk,bkhd->bqhd", p, kv[..., nope:]).reshape(b, n, nh * vd)


def reference_draft_logits(
    tensors: dict,
    raw: dict,
    hidden_states: np.ndarray,
    tokens: np.ndarray,
    ids: list[int],
    target_embed: np.ndarray,
    perturb: str | None = None,
) -> np.ndarray:
    """First-step logits [b, T-1, V] in float64, straight from the hub tensors: row i fuses
    transformers' hidden_states[id] (the INPUT of layer id) at position i with token i+1."""
    t = {
        k.removeprefix("model.").replace("layers.0.", "midlayer."): np.asarray(v, np.float64)
        for k, v in tensors.items()
    }
    eps = raw["rms_norm_eps"]
    nh = raw["num_attention_heads"]
    vocab, n = raw["vocab_size"], tokens.shape[1] - 1
    if perturb == "shift_layers":
        ids = [i + 1 for i in ids]
    feats = np.concatenate([hidden_states[i][:, :n] for i in ids], -1).astype(np.float64)
    g = feats @ t["fc.weight"].T
    embed = t.get("embed_tokens.weight", np.asarray(target_embed, np.float64))
    e = _rms(embed[tokens[:, 1:]], t["midlayer.input_layernorm.weight"], eps)
    hn = _rms(g, t["midlayer.hidden_norm.weight"], eps)
    u = np.concatenate([hn, e] if perturb == "swap_concat" else [e, hn], -1)
    norm_residual = raw.get("norm_before_residual", False) != (perturb == "norm_residual")
    residual = hn if norm_residual else g
    a = "midlayer.self_attn."
    attend = _mla_attention if "kv_lora_rank" in raw else _gqa_attention
    attn = attend(t, raw, u, a, nh)
    h1 = residual + attn @ t[a + "o_proj.weight"].T
    x = _rms(h1, t["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = x @ t["midlayer.mlp.gate_proj.weight"].T, x @ t["midlayer.mlp.up_proj.weight"].T
    h2 = h1 + (gate / (1 + np.exp(-gate)) * up) @ t["midlayer.mlp.down_proj.weight"].T
    logits = _rms(h2, t["norm.weight"], eps) @ t["lm_head.weight"].T
    if "d2t" not in t:
        return logits
    d2t = t["d2t"].astype(np.int64)
    target_ids = d2t if perturb == "d2t_as_ids" else np.arange(len(d2t)) + d2t
    full = np.full(logits.shape[:-1] + (vocab,), -np.inf)
    full[..., target_ids] = logits
    return full


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    assert np.array_equal(np.isinf(got), np.isinf(want)), "the -inf pattern (draft vocabulary) differs"
    fin = np.isfinite(want)
    return float(np.linalg.norm(got[fin] - want[fin]) / np.linalg.norm(want[fin]))


@pytest.fixture(scope="module")
def target():
    return mtp_jax.load(TARGET, "float32", strict=True)


def _with_draft(path: str, **kw) -> mtp_jax.Model:
    return mtp_jax.load(TARGET, "float32", strict=True, draft_model=path, **kw)


# --- the forward ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a_midlayer", "b"])
def test_draft_logits_match_the_published_math(drafts, target, name):
    path, tensors, raw = drafts[name]
    model = _with_draft(path)
    tokens = REF["input_ids"]
    got = model.draft_logits(tokens)
    embed = np.asarray(target.params["embed"])
    ids = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", [2, 3 // 2, 3 - 3])
    want = reference_draft_logits(tensors, raw, REF["hidden_states"], tokens, ids, embed)
    assert got.shape == (2, tokens.shape[1] - 1, 128) and got.dtype == np.float32
    assert _rel(got, want) < 1e-5
    # each way of getting the published math wrong moves the logits far outside that tolerance
    perturbations = ["swap_concat", "norm_residual", "shift_layers"] + (
        ["d2t_as_ids"] if "d2t" in tensors else []
    )
    for perturb in perturbations:
        wrong = reference_draft_logits(tensors, raw, REF["hidden_states"], tokens, ids, embed, perturb)
        fin = np.isfinite(got) & np.isfinite(wrong)
        err = np.linalg.norm(got[fin] - wrong[fin]) / np.linalg.norm(wrong[fin])
        assert (np.isinf(got) != np.isinf(wrong)).any() or err > 1e-2, perturb


def test_layer_ids_read_as_outputs(tmp_path):
    # ids [0, 1, 1] (a repeat too): as outputs, transformers' hidden_states[1], [2], [2] (its last
    # entry, [3], is after the final norm, so the last layer's output is not in the fixture)
    raw = {**DRAFT_A, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}}
    tensors = draft_tensors(raw)
    write_hub_checkpoint(tmp_path / "d", raw, tensors)
    model = _with_draft(str(tmp_path / "d"), draft_layer_ids="outputs")
    assert model.draft_config.capture == (0, 1, 1)
    got = model.draft_logits(REF["input_ids"])
    embed = np.asarray(model.params["embed"])
    want = reference_draft_logits(tensors, raw, REF["hidden_states"], REF["input_ids"], [1, 2, 2], embed)
    assert _rel(got, want) < 1e-5


def test_three_dialects_load_the_same_draft(drafts, capsys):
    logits = []
    for name in ("a_midlayer", "a_layers0", "a_nemo"):
        model = _with_draft(drafts[name][0])
        assert model.drafts == ("eagle3",)
        assert "embed" not in model.params["eagle3"]  # absent: the target's is used
        logits.append(model.draft_logits(REF["input_ids"][:1, :12]))
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_array_equal(logits[0], logits[2])
    assert "reads target outputs of the embedding, layer 0, layer 1" in capsys.readouterr().err


def test_capture_defaults_and_readings():
    cfg = Eagle3Config.from_dict({k: v for k, v in DRAFT_A.items() if k != "eagle_config"})
    assert eagle3_capture(cfg, 32) == (1, 15, 28)  # inputs of 2, 16, 29 (Llama 3.1 8B)
    assert eagle3_capture(cfg, 61) == (1, 29, 57)  # inputs of 2, 30, 58 (DeepSeek-V3)
    top_level = {k: v for k, v in DRAFT_A.items() if k != "eagle_config"}
    spec = Eagle3Config.from_dict({**top_level, "eagle_aux_hidden_state_layer_ids": [1, 29, 57]})
    assert eagle3_capture(spec, 61, "outputs") == (1, 29, 57)
    assert eagle3_capture(spec, 61, "inputs") == (0, 28, 56)
    with pytest.raises(ConfigError, match="id 61 is beyond the target's 61 layers"):
        eagle3_capture(
            Eagle3Config.from_dict(
                {**DRAFT_A, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 61]}}
            ),
            61,
        )


def test_embedding_equal_to_the_target_is_stored_once(drafts, target, tmp_path):
    _, tensors, raw = drafts["a_midlayer"]
    same = dict(tensors, **{"embed_tokens.weight": np.asarray(target.params["embed"])})
    write_hub_checkpoint(tmp_path / "same", raw, same)
    model = _with_draft(str(tmp_path / "same"))
    assert "embed" not in model.params["eagle3"]
    other = dict(tensors, **{"embed_tokens.weight": np.asarray(target.params["embed"]) * 2})
    write_hub_checkpoint(tmp_path / "other", raw, other)
    model = _with_draft(str(tmp_path / "other"))
    assert "embed" in model.params["eagle3"]
    want = reference_draft_logits(other, raw, REF["hidden_states"], REF["input_ids"], [0, 1, 2], None)
    assert _rel(model.draft_logits(REF["input_ids"]), want) < 1e-5


def test_mla_draft_matches_the_published_math(drafts, tmp_path):
    """An MLA draft on a DeepSeek-V3 target: transformers' hidden states, ids [1, 2, 0] read as
    layer inputs (a repeat-free but unordered choice: concatenated in the order written)."""
    path, tensors, raw = drafts["mla"]
    model = mtp_jax.load(DEEPSEEK_TARGET, "float32", strict=True, draft_model=path)
    assert model.draft_config.mla is not None and model.draft_config.capture == (0, 1, -1)
    tokens = DEEPSEEK_REF["input_ids"]
    embed = np.asarray(model.params["embed"])
    got = model.draft_logits(tokens)
    want = reference_draft_logits(tensors, raw, DEEPSEEK_REF["hidden_states"], tokens, [1, 2, 0], embed)
    assert _rel(got, want) < 1e-5
    for perturb in ("swap_concat", "norm_residual", "d2t_as_ids"):
        wrong = reference_draft_logits(
            tensors, raw, DEEPSEEK_REF["hidden_states"], tokens, [1, 2, 0], embed, perturb
        )
        fin = np.isfinite(got) & np.isfinite(wrong)
        err = np.linalg.norm(got[fin] - wrong[fin]) / np.linalg.norm(wrong[fin])
        assert (np.isinf(got) != np.isinf(wrong)).any() or err > 1e-2, perturb
    # its cache is MLA's latent rows, and speculation with it is lossless. This target never
    # accepts the random draft, so that runs on a copy that always proposes a token the target
    # emits often: its head zeroed, every draft logit ties and the lowest target id of its draft
    # vocabulary wins; the vocabulary made the 48 ids from that token up
    plain = model.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    size, vocab = raw["draft_vocab_size"], raw["vocab_size"]
    emitted = np.bincount(np.concatenate(plain.tokens), minlength=vocab)[: vocab - size + 1]
    favourite = int(np.argmax(emitted))
    assert emitted[favourite] >= 3
    ids = favourite + np.arange(size)
    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    proposing = {
        **tensors,
        "lm_head.weight": np.zeros_like(tensors["lm_head.weight"]),
        "d2t": ids - np.arange(size),
        "t2d": t2d,
    }
    write_hub_checkpoint(tmp_path / "proposing", raw, proposing)
    model = mtp_jax.load(DEEPSEEK_TARGET, "float32", strict=True, draft_model=str(tmp_path / "proposing"))
    for k in (1, 4):
        spec = model.generate(
            PROMPTS, max_new_tokens=10, ignore_eos=True, draft="eagle3", num_speculative_tokens=k
        )
        assert spec.tokens == plain.tokens, k
        assert_speculated(spec.stats, k)


@pytest.mark.parametrize("name", ["a_midlayer", "b", "mla"])
def test_export_round_trips_bit_exact(drafts, name):
    """params["eagle3"] -> hub tensors (the layers.0. dialect our training script writes) gives back
    exactly the published tensors, d2t/t2d and an own embedding included."""
    from mtp_jax.drafts.eagle3.export import eagle3_hub_tensors_from_params

    path, tensors, raw = drafts[name]
    target_dir = DEEPSEEK_TARGET if name == "mla" else TARGET
    model = mtp_jax.load(target_dir, "float32", strict=True, draft_model=path)
    back = eagle3_hub_tensors_from_params(model.params["eagle3"], model.draft_config)
    prefix = {"a_midlayer": "midlayer.", "b": "model.layers.0.", "mla": "layers.0."}[name]
    want = {k.replace(prefix, "layers.0.").removeprefix("model."): v for k, v in tensors.items()}
    assert sorted(back) == sorted(want)
    for key, value in want.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key


@pytest.mark.parametrize("name", ["b", "mla"])
def test_plan_builds_the_loaded_drafts_tree(drafts, name):
    """``mtp-jax plan``'s abstract tree of the draft (from its config alone: the draft's own
    ``abstract_params``, MLA attention through DeepSeek-V3's declarations) has the loaded tree's
    structure, shapes and dtypes, on one device."""
    from mtp_jax.plan import abstract_params
    from mtp_jax.sharding import make_mesh

    path = drafts[name][0]
    model = mtp_jax.load(
        DEEPSEEK_TARGET if name == "mla" else TARGET, "float32", strict=True, draft_model=path
    )
    mesh = make_mesh(devices=jax.devices()[:1])
    planned = abstract_params(
        model.config, mesh, jnp.float32, weights="bf16", mtp=False, draft_cfg=model.draft_config
    )
    real = model.params["eagle3"]
    assert jax.tree.structure(real) == jax.tree.structure(planned["eagle3"])
    for r, a in zip(jax.tree.leaves(real), jax.tree.leaves(planned["eagle3"]), strict=True):
        assert (r.shape, r.dtype) == (a.shape, a.dtype)


# --- training's chained levels -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a_midlayer", "b", "mla"])
def test_chain_teacher_forced_matches_the_decode_chain(drafts, name):
    """The training-time test (all chained levels at once, dense) equals decoding's chain over the
    draft's paged cache: catch-up rows 0..i from target features, then the draft fed its own
    recycled state (pre-norm, or post-norm with norm_output) and the next true token at positions
    i+1, i+2 (GQA with a draft vocabulary, GQA with both variant flags, MLA)."""
    from mtp_jax.cache import page_table_array, slots_for
    from mtp_jax.drafts.eagle3.draft import (
        DRAFT,
        draft_vocab_logits,
        eagle3_chain_teacher_forced,
        eagle3_layer,
        eagle3_logits,
        fused_features,
        recycled,
    )
    from mtp_jax.step import StepConfig

    path = drafts[name][0]
    target_dir, ref = (DEEPSEEK_TARGET, DEEPSEEK_REF) if name == "mla" else (TARGET, REF)
    model = mtp_jax.load(target_dir, "float32", strict=True, draft_model=path)
    cfg, params = model.draft_config, model.params
    ids = jnp.asarray(ref["input_ids"])
    b, t = ids.shape
    feats = jnp.asarray(fused_features(model.hidden_states(ref["input_ids"], cfg.capture).layers))
    depth = 3
    n = t - 1 - depth
    # jitted, as training and decoding run them: op by op they compiled ~300 one-op programs
    chain = jax.jit(eagle3_chain_teacher_forced, static_argnames=("cfg", "depth"))
    levels = chain(params, cfg, ids, feats, depth)
    assert [lv.shape for lv in levels] == [(b, n, cfg.hidden_size)] * depth
    first = model.draft_logits(ref["input_ids"])[:, :n]
    assert _rel(np.asarray(eagle3_logits(params, cfg, levels[0])), first) < 1e-5
    assert draft_vocab_logits(params, levels[0]).shape == (b, n, cfg.draft_vocab_size)
    page = 4
    width = -(-t // page)
    table = jnp.asarray(page_table_array([list(range(r * width, (r + 1) * width)) for r in range(b)], width))
    sc = StepConfig(model.config, page, 1, "eagle3", draft_cfg=cfg)

    @functools.partial(jax.jit, static_argnames="features")
    def run(pages, tokens, state, pos, features):
        paged = PagedAttention(pages, slots_for(table, pos, jnp.ones(pos.shape, bool), page), table)
        return eagle3_layer(params, cfg, tokens, state, pos, features=features, paged=paged)

    for i in (n // 2,):  # a middle row: sees earlier rows, must not see later ones
        pages = DRAFT.init_state(sc, b * width, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(i + 1), (b, i + 1))
        h2, normed, pages = run(pages, ids[:, 1 : i + 2], feats[:, : i + 1], pos, True)
        assert _rel(np.asarray(normed[:, -1]), np.asarray(levels[0][:, i])) < 1e-5
        state = recycled(cfg, h2[:, -1:], normed[:, -1:])
        for j in range(2, depth + 1):
            pos = jnp.full((b, 1), i + j - 1)
            h2, normed, pages = run(pages, ids[:, i + j : i + j + 1], state, pos, False)
            state = recycled(cfg, h2, normed)
            assert _rel(np.asarray(normed[:, 0]), np.asarray(levels[j - 1][:, i])) < 1e-5, (i, j)


def test_roofline_counts_the_eagle3_draft(drafts, target, tmp_path):
    """scripts/bench_step.py with an EAGLE-3 draft: per pass the layer, fc once, the draft's own head
    (draft vocabulary) once per draft, its embedding rows (the target's), its K/V cache per pass;
    then the step it times runs with that draft."""
    from mtp_jax.roofline import build_parser, run, step_bytes

    model = _with_draft(drafts["a_midlayer"][0])
    cfg, d = model.draft_config, model.draft_config.hidden_size
    k, batch, context = 3, 2, 9
    plain = step_bytes(target.params, target.config, k=0, batch=batch, context=context, cache_itemsize=4)
    got = step_bytes(
        model.params, model.config, k=k, batch=batch, context=context, cache_itemsize=4, draft_cfg=cfg
    )
    tree = model.params["eagle3"]
    size = {name: int(np.prod(x.shape)) for name, x in tree.items() if name not in ("attn", "mlp")}
    layer = sum(int(np.prod(x.shape)) for x in jax.tree.leaves([tree["attn"], tree["mlp"]]))
    layer += sum(size[n] for n in ("hidden_norm", "input_norm", "post_attn_norm", "norm"))
    passes = [batch * (k + 1)] + [batch] * (k - 1)
    assert got.draft_heads == pytest.approx(4 * k * (size["lm_head"] + size["draft_to_target"]))
    assert got.draft_weights == pytest.approx(4 * (k * layer + size["fc"] + d * sum(passes)))
    positions = batch * (context + k + 1)
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim
    target_kv = plain.kv / (batch * (context + 1))
    assert got.kv == pytest.approx(positions * target_kv + k * positions * per_token * 4)
    with pytest.raises(ValueError, match="EAGLE-3 draft in params"):
        step_bytes(target.params, target.config, k=1, batch=1, context=4, cache_itemsize=4, draft_cfg=cfg)
    args = ["--model", TARGET, "--draft-model", drafts["a_midlayer"][0], "--k", "0", "2"]
    out = run(build_parser().parse_args([*args, "--iters", "2", "--copy-mb", "4", "--context", "8"]))
    assert [r["draft"] for r in out["results"]] == [None, "eagle3"] and out["model"].endswith("a_midlayer")
    assert all(r["step_ms"] > 0 for r in out["results"])


# --- bad drafts -----------------------------------------------------------------------------------
def _bad(tmp_path, raw=None, tensors=None, drop=(), **extra) -> str:
    raw = copy.deepcopy(DRAFT_A if raw is None else raw)
    tensors = dict(draft_tensors(DRAFT_A) if tensors is None else tensors, **extra)
    for key in drop:
        tensors.pop(key)
    path = tmp_path / f"bad{len(os.listdir(tmp_path))}"
    write_hub_checkpoint(path, raw, tensors)
    return str(path)


def test_bad_drafts_are_refused_by_name(tmp_path):
    t = draft_tensors(DRAFT_A)
    mixed = {k.replace("midlayer.mlp", "layers.0.mlp"): v for k, v in t.items()}
    cases = [
        (_bad(tmp_path, tensors=mixed), CheckpointError, "mixes EAGLE-3 key dialects"),
        (_bad(tmp_path, {**DRAFT_A, "target_hidden_size": 48}), ConfigError, "width 48 .* hidden_size is 32"),
        (_bad(tmp_path, {**DRAFT_A, "vocab_size": 129}), ConfigError, "vocab_size is 129, the target's 128"),
        (_bad(tmp_path, d2t=t["d2t"] + 200), CheckpointError, "outside \\[0, 128\\); d2t holds offsets"),
        (_bad(tmp_path, d2t=5 - np.arange(48, dtype=np.int64)), CheckpointError, "maps several draft ids"),
        (_bad(tmp_path, drop=["d2t", "t2d"]), CheckpointError, "no 'd2t'"),
        (_bad(tmp_path, {**DRAFT_A, "draft_vocab_size": 47}), CheckpointError, "lm_head.weight' has shape"),
        (
            _bad(tmp_path, {**DRAFT_A, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}),
            ConfigError,
            "id 3 is beyond the target's 3 layers",
        ),
        (
            _bad(tmp_path, {**DRAFT_A, "norm_before_fc": True}),
            ConfigError,
            "norm_before_fc=true is not supported",
        ),
        (
            _bad(tmp_path, drop=["midlayer.hidden_norm.weight"]),
            CheckpointError,
            "missing tensor 'midlayer.hidden_norm",
        ),
        (
            _bad(tmp_path, **{"midlayer.self_attn.q_a_proj.weight": np.zeros((4, 64), np.float32)}),
            ConfigError,
            "missing the required field 'kv_lora_rank'",
        ),
        (_bad(tmp_path, {**DRAFT_A, "num_hidden_layers": 2}), ConfigError, "exactly one decoder layer"),
    ]
    for path, error, match in cases:
        with pytest.raises(error, match=match):
            _with_draft(path)
    with pytest.raises(ValueError, match="draft_layer_ids must be one of"):
        _with_draft(cases[0][0], draft_layer_ids="middle")
    with pytest.raises(mtp_jax.InvalidRequestError, match="needs an EAGLE-3 draft loaded"):
        mtp_jax.load(TARGET, "float32").generate([[1, 2]], draft="eagle3")


# --- speculative generation -----------------------------------------------------------------------
PROMPTS = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [100], [8, 8, 8, 8, 8, 8, 8]]


@pytest.mark.parametrize("name", ["a_midlayer", "b"])
def test_greedy_speculation_is_lossless_on_llama(drafts, target, name):
    model = _with_draft(drafts[name][0])
    plain = target.generate(PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3)
    for k in (1, 3, 5):
        out = model.generate(
            PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3, draft="eagle3", num_speculative_tokens=k
        )
        assert out.tokens == plain.tokens, k
        assert out.stats["acceptance_length"] > 1.0, (k, out.stats)  # not vacuous: drafts were accepted
    check_per_request_k(model, "eagle3", PROMPTS, plain.tokens)


def test_greedy_speculation_is_lossless_on_deepseek(tmp_path, tiny_model):
    raw = {
        **DRAFT_A,
        "vocab_size": 97,
        "draft_vocab_size": 97,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    cfg = Eagle3Config.from_dict(raw)
    write_hub_checkpoint(tmp_path / "d", raw, eagle3_hub_tensors(cfg, 3, 0.2))
    model = mtp_jax.load(tiny_model.path, "float32", page_size=4, draft_model=str(tmp_path / "d"))
    assert set(model.drafts) == {"mtp", "eagle3"}
    prompts = [[p % 97 for p in prompt] for prompt in PROMPTS]
    plain = tiny_model.generate(prompts, max_new_tokens=10, ignore_eos=True)
    for k in (1, 4):
        out = model.generate(
            prompts, max_new_tokens=10, ignore_eos=True, draft="eagle3", num_speculative_tokens=k
        )
        assert out.tokens == plain.tokens, k
        assert out.stats["acceptance_length"] > 1.0, (k, out.stats)  # not vacuous: drafts were accepted
    assert model.draft_logits([prompts[1]], draft="mtp").shape == (1, len(prompts[1]) - 1, 97)


# Sharded like the target, on 8 simulated devices: Llama 3 + EAGLE-3 tensor-parallel (draft heads,
# MLP columns and draft vocabulary split; KV heads split over 2, replicated over 4) and DeepSeek-V3 +
# EAGLE-3 (GQA and MLA drafts) expert-parallel; draft logits, greedy and sampled speculative tokens
# equal one device's.
SHARDED_CHILD = textwrap.dedent(
    """
    import os, sys, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    assert len(jax.devices()) == 8
    import mtp_jax
    from mtp_jax.drafts.eagle3.synthetic import eagle3_hub_tensors
    from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from mtp_jax.drafts.eagle3.config import Eagle3Config, parse_eagle3_config
    from tests.conftest import TINY_CONFIG
    from tests.drafts.test_eagle3 import DRAFT_A, DRAFT_IDS, DRAFT_MLA, TARGET, check_planned_draft

    tmp = tempfile.mkdtemp()
    llama_draft = os.path.join(tmp, "llama_draft")
    raw = dict(DRAFT_A, num_key_value_heads=2)
    tensors = eagle3_hub_tensors(Eagle3Config.from_dict(raw), 1, 0.2, draft_ids=DRAFT_IDS)
    write_hub_checkpoint(llama_draft, raw, tensors)
    ds_target, ds_draft = os.path.join(tmp, "ds"), os.path.join(tmp, "ds_draft")
    write_hub_checkpoint(ds_target, TINY_CONFIG, hub_tensors(DeepseekV3Config.from_dict(TINY_CONFIG), seed=0))
    raw = dict(DRAFT_A, vocab_size=97, draft_vocab_size=97)
    write_hub_checkpoint(ds_draft, raw, eagle3_hub_tensors(Eagle3Config.from_dict(raw), 2, 0.2))
    ds_mla = os.path.join(tmp, "ds_mla")
    raw = dict(DRAFT_MLA, hidden_size=32, vocab_size=97, draft_vocab_size=40)
    cfg = parse_eagle3_config(raw, mla=True)
    write_hub_checkpoint(ds_mla, raw, eagle3_hub_tensors(cfg, 3, 0.2, draft_ids=np.arange(0, 80, 2)))

    prompts = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [10], [8, 8, 8, 8, 8, 8, 8], [3, 1]]
    spec = dict(max_new_tokens=10, ignore_eos=True, draft="eagle3", num_speculative_tokens=3)
    sampled = dict(spec, temperature=0.9, top_k=20, seed=[1, 2, 3, 4, 5])
    for target, draft, meshes in [
        (TARGET, llama_draft, [dict(data=4, tensor=2), dict(data=2, tensor=4)]),
        (ds_target, ds_draft, [dict(data=2, expert=4), dict(data=8)]),
        (ds_target, ds_mla, [dict(data=2, expert=4)]),
    ]:
        one = mtp_jax.load(target, "float32", page_size=4, draft_model=draft)
        want_logits = one.draft_logits([prompts[1]])
        want = {how: one.generate(prompts, draft_sampling=how, **kw).tokens
                for how, kw in (("argmax", spec), ("sampled", sampled))}
        for axes in meshes:
            mesh = mtp_jax.make_mesh(**axes)
            model = mtp_jax.load(target, "float32", page_size=4, draft_model=draft, mesh=mesh)
            got = model.draft_logits([prompts[1]])
            fin = np.isfinite(want_logits)
            assert np.array_equal(fin, np.isfinite(got)), axes
            np.testing.assert_allclose(got[fin], want_logits[fin], rtol=2e-5, atol=2e-5)
            for how, kw in (("argmax", spec), ("sampled", sampled)):
                got = model.generate(prompts, draft_sampling=how, **kw).tokens
                assert got == want[how], (target, axes, how)
            if "tensor" in axes:
                q = model.params["eagle3"]["attn"]["q"]
                assert q.addressable_shards[0].data.shape[1] == 4 // axes["tensor"], q.sharding
            if axes is meshes[0]:
                check_planned_draft(model, mesh, axes, "eagle3", 2, "EAGLE-3 K=2")
    print("EAGLE3-SHARDED-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(SHARDED_CHILD)
def test_sharded_like_the_target(child_output):
    assert "EAGLE3-SHARDED-OK" in child_output


def check_planned_draft(model, mesh, axes: dict, group: str, k: int, label: str) -> None:
    """(In a multi-device child.) ``mtp-jax plan`` builds the loaded draft's group from its config
    alone, with the same shapes, dtypes and shardings, and compiles the step with it."""
    from mtp_jax.plan import abstract_params, format_plan, plan

    planned = abstract_params(
        model.config, mesh, jnp.float32, weights="bf16", mtp=False, draft_cfg=model.draft_config
    )[group]
    real = model.params[group]
    assert jax.tree.structure(real) == jax.tree.structure(planned), axes
    for (where, r), a in zip(
        jax.tree_util.tree_flatten_with_path(real)[0], jax.tree.leaves(planned), strict=True
    ):
        assert (r.shape, r.dtype) == (a.shape, a.dtype), (where, r.shape, a.shape, a.dtype)
        assert r.sharding.is_equivalent_to(a.sharding, r.ndim), (where, r.sharding, a.sharding)
    report = plan(
        model.config,
        axes,
        batch=8,
        max_len=24,
        page_size=4,
        k=k,
        weights="bf16",
        dtype="float32",
        draft_cfg=model.draft_config,
    )
    assert report.draft == group and label in format_plan(report), axes


def test_k16_is_lossless_compiles_once_and_rows_ignore_the_batch(drafts, target):
    """K = 16 (the largest) in one compilation, and a sampled row's tokens the same alone and in a
    batch of other prompts, seeds and sampling parameters."""
    from mtp_jax.step import step

    model = _with_draft(drafts["a_midlayer"][0])
    spec = dict(max_new_tokens=20, ignore_eos=True, draft="eagle3", num_speculative_tokens=16)
    plain = target.generate(PROMPTS[:2], max_new_tokens=20, ignore_eos=True)
    out = model.generate(PROMPTS[:2], **spec)
    assert out.tokens == plain.tokens
    assert_speculated(out.stats)
    seen = step._cache_size()
    again = model.generate(PROMPTS[:2], **{**spec, "max_new_tokens": 25})
    assert again.stats["steps"] > 3 and step._cache_size() == seen
    mine = dict(temperature=0.9, top_k=30, top_p=0.95, seed=11)
    kw = dict(max_new_tokens=12, ignore_eos=True, draft="eagle3", num_speculative_tokens=3)
    kw["draft_sampling"] = "sampled"
    alone = model.generate([PROMPTS[1]], **mine, **kw).tokens[0]
    batch = model.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[3]],
        temperature=[1.2, 0.9, 0.0],
        top_k=[0, 30, 5],
        top_p=[0.8, 0.95, 1.0],
        seed=[4, 11, 9],
        **kw,
    ).tokens
    assert batch[1] == alone
