"""LoRA adapters (mtp_jax/lora.py): parity with transformers + peft on committed adapters
(scripts/make_lora_parity_fixtures.py) over the Llama-family parity checkpoints, several ranks,
rsLoRA, rank/alpha patterns, layers_to_transform and a regex target_modules; greedy generation equal
to peft's; a mixed batch equal to each row alone; speculation with adapters lossless; loading and
unloading while models are in use compiles nothing; the refusals."""

from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import SafetensorsFile, save_safetensors
from mtp_jax.errors import InvalidRequestError
from mtp_jax.lora import AdapterError, read_adapter
from tests.conftest import REPO, greedy_reference

LORA = os.path.join(REPO, "tests", "fixtures", "lora")
FIXTURES = os.path.join(REPO, "tests", "fixtures")
NAMES = sorted(os.listdir(LORA))
LLAMA_ADAPTERS = ["llama_attn_r8", "llama_all_rslora_patterns"]  # both over llama3_gqa42


def read_text(path) -> str:
    with open(path) as f:
        return f.read()


def base_of(name: str) -> str:
    return os.path.join(FIXTURES, read_text(os.path.join(LORA, name, "base.txt")).strip())


def reference(name: str) -> dict:
    return dict(np.load(os.path.join(LORA, name, "reference.npz")))


@pytest.fixture(scope="module")
def llama():
    """The Llama parity checkpoint with both of its adapters, and a free slot."""
    adapters = {name: os.path.join(LORA, name) for name in LLAMA_ADAPTERS}
    return mtp_jax.load(
        base_of(LLAMA_ADAPTERS[0]), "float32", lora_adapters=adapters, max_loras=3, page_size=4
    )


def test_fixtures_cover_what_the_issue_names():
    configs = {name: json.loads(read_text(os.path.join(LORA, name, "adapter_config.json"))) for name in NAMES}
    assert {c["r"] for c in configs.values()} >= {2, 4, 8, 16}
    assert any(c["use_rslora"] for c in configs.values())
    assert any(c["rank_pattern"] and c["alpha_pattern"] for c in configs.values())
    assert any(c["layers_to_transform"] for c in configs.values())
    assert any(isinstance(c["target_modules"], str) for c in configs.values())  # a regex
    assert {read_text(os.path.join(LORA, n, "base.txt")).strip() for n in NAMES} == {
        "parity_llama/llama3_gqa42",
        "parity_llama/qwen2_bias_tied",
        "parity_llama/qwen3_qk_norm",
        "parity/base",
        "parity/odd_heads",
    }


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_peft(name):
    ref = reference(name)
    model = mtp_jax.load(base_of(name), "float32", lora_adapters={name: os.path.join(LORA, name)})
    adapted = model.logits(ref["input_ids"], lora=name)
    base = model.logits(ref["input_ids"])
    scale = np.abs(ref["logits"]).max()
    # 2e-5: every slot's ranks are contracted side by side (the others' multiplied by zero), so the
    # float32 sums run in another order than peft's; the base model's logits stay within 1e-5
    assert np.abs(adapted - ref["logits"]).max() <= 2e-5 * scale
    assert np.abs(base - ref["base_logits"]).max() <= 1e-5 * scale
    # not vacuous: the adapter moves the logits far beyond that tolerance
    assert np.abs(ref["logits"] - ref["base_logits"]).max() > 1e-2 * scale


def test_greedy_equals_peft_and_speculation_stays_lossless(llama):
    accepted = 0
    for name in LLAMA_ADAPTERS:
        prompts, n, want = greedy_reference(reference(name))
        out = llama.generate(prompts, max_new_tokens=n, ignore_eos=True, lora=name)
        assert out.tokens == want, name
        # n-gram proposes where the text repeats: each prompt, its greedy continuation, the prompt
        # again (the adapted model then tends to repeat that continuation)
        echo = [p + w + p for p, w in zip(prompts, want, strict=True)]
        echo_plain = llama.generate(echo, max_new_tokens=n, ignore_eos=True, lora=name).tokens
        for k in (1, 3):  # the target verifies with the row's adapter: greedy stays lossless
            kw = dict(max_new_tokens=n, ignore_eos=True, lora=name, draft="ngram", num_speculative_tokens=k)
            assert llama.generate(prompts, **kw).tokens == want, (name, k)
            spec = llama.generate(echo, **kw)
            assert spec.tokens == echo_plain, (name, k)
            assert spec.stats["num_draft_tokens"] > 0, (name, k)  # drafts were verified (counted as such)
            accepted += spec.stats["num_accepted_tokens"]
    assert accepted > 0  # and some accepted: the acceptance path ran with adapters


def test_a_mixed_batch_equals_each_row_alone(llama):
    ref = reference(LLAMA_ADAPTERS[0])
    rows = np.concatenate([ref["input_ids"], ref["input_ids"][:1]])
    names = [LLAMA_ADAPTERS[0], None, LLAMA_ADAPTERS[1]]
    mixed = llama.logits(rows, lora=names)
    for i, name in enumerate(names):
        alone = llama.logits(rows[i : i + 1], lora=name)[0]
        np.testing.assert_allclose(mixed[i], alone, rtol=1e-5, atol=1e-5 * np.abs(alone).max())
    prompts = [[int(t) for t in row[:6]] for row in rows]
    together = llama.generate(prompts, max_new_tokens=8, ignore_eos=True, lora=names).tokens
    for i, name in enumerate(names):
        assert (
            together[i]
            == llama.generate([prompts[i]], max_new_tokens=8, ignore_eos=True, lora=name).tokens[0]
        )
    # per-request settings carry the adapter too
    params = [mtp_jax.SamplingParams(max_new_tokens=8, ignore_eos=True, lora=name) for name in names]
    assert llama.generate(prompts, params).tokens == together


def test_loading_and_unloading_compile_nothing(llama, tmp_path):
    from mtp_jax.step import prefill, step

    ref = reference(LLAMA_ADAPTERS[0])
    prompts = [[int(t) for t in row[:6]] for row in ref["input_ids"]]
    kw = dict(max_new_tokens=8, ignore_eos=True, draft="ngram", num_speculative_tokens=2)
    first = llama.generate(prompts, lora=LLAMA_ADAPTERS[0], **kw).tokens
    seen = (step._cache_size(), prefill._cache_size())
    # the same adapter under a second name, in the free slot: the same tokens, nothing compiled
    shutil.copytree(os.path.join(LORA, LLAMA_ADAPTERS[0]), tmp_path / "copy")
    llama.load_lora("copy", tmp_path / "copy")
    try:
        assert llama.generate(prompts, lora="copy", **kw).tokens == first
        assert (step._cache_size(), prefill._cache_size()) == seen
        assert set(llama.loras) == {*LLAMA_ADAPTERS, "copy"}
    finally:
        llama.unload_lora("copy")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'copy'"):
        llama.generate(prompts, lora="copy", **kw)
    assert llama.generate(prompts, lora=LLAMA_ADAPTERS[0], **kw).tokens == first  # the others untouched
    assert (step._cache_size(), prefill._cache_size()) == seen


def _adapter_copy(tmp_path, name: str = LLAMA_ADAPTERS[0], config=None, tensors=None) -> str:
    """A copy of a fixture adapter with its config updated by ``config`` and tensors by ``tensors``
    (None values remove a tensor)."""
    dst = tmp_path / "adapter"
    shutil.copytree(os.path.join(LORA, name), dst)
    raw = json.loads(read_text(dst / "adapter_config.json"))
    raw.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(raw))
    if tensors:
        f = SafetensorsFile(dst / "adapter_model.safetensors")
        values = {k: f.get(k) for k in f.keys()}
        f.close()
        for key, value in tensors.items():
            if value is None:
                values.pop(key)
            else:
                values[key] = value
        save_safetensors(str(dst / "adapter_model.safetensors"), values)
    return str(dst)


Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def test_an_adapter_loaded_while_serving_changes_only_its_own_requests(llama, tmp_path):
    """Engine.load_lora between two steps of running requests: they go on as they would have, the
    new adapter's request decodes with it; unloading waits for its requests (refused meanwhile)."""
    ref = reference(LLAMA_ADAPTERS[0])
    prompts = [[int(t) for t in row[:6]] for row in ref["input_ids"]]
    extra = write_random_adapter(tmp_path / "extra", llama, 8, ["q_proj", "down_proj"], seed=5, alpha=32)
    kw = dict(ignore_eos=True, draft="ngram", num_speculative_tokens=2)
    alone = {
        name: llama.generate(prompts[:1], max_new_tokens=48, lora=name, **kw).tokens[0]
        for name in (LLAMA_ADAPTERS[0], None)
    }
    llama.load_lora("extra", extra)
    want = llama.generate(prompts[1:2], max_new_tokens=8, lora="extra", **kw).tokens[0]
    llama.unload_lora("extra")
    assert want != llama.generate(prompts[1:2], max_new_tokens=8, **kw).tokens[0]
    with mtp_jax.Engine(llama, slots=4, max_len=64, draft="ngram", num_speculative_tokens=2) as engine:
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'extra'"):
            engine.submit(prompts[1], max_new_tokens=8, lora="extra")
        running = [engine.submit(prompts[0], max_new_tokens=48, ignore_eos=True, lora=name) for name in alone]
        go = threading.Event()
        go.set()
        engine.step_gate = go.is_set
        next(iter(running[0]))  # decoding
        go.clear()  # no step from here until the adapter is loaded (at most 3 tokens a step ran on)
        engine.load_lora("extra", extra)
        assert not running[0].done  # loaded between two of its steps
        go.set()
        new = engine.submit(prompts[1], max_new_tokens=8, ignore_eos=True, lora="extra")
        with pytest.raises(InvalidRequestError, match="'extra' is in use by 1 waiting or running"):
            engine.unload_lora("extra")
        assert [r.result(60).tokens for r in running] == list(alone.values())
        assert new.result(60).tokens == want
        engine.unload_lora("extra")
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'extra'"):
            engine.unload_lora("extra")
        with pytest.raises(InvalidRequestError, match="is loaded already"):
            engine.load_lora(LLAMA_ADAPTERS[0], extra)
    assert llama.loras == tuple(LLAMA_ADAPTERS)


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, None, "DoRA"),
        ({"peft_type": "IA3"}, None, "not a LoRA adapter"),
        ({"bias": "all"}, None, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"r": 0}, None, "r must be a positive integer"),
        (None, {Q0.format("B"): None}, "has lora_A but no lora_B"),
        (None, {Q0.format("A"): np.zeros((8, 33), np.float32)}, "do not fit the base model"),
        ({"r": 8, "rank_pattern": {"q_proj": 4}}, None, "rank 8, adapter_config.json says 4"),
        (
            None,
            {"base_model.model.model.embed_tokens.lora_A.weight": np.zeros((8, 128), np.float32)},
            "the token embedding",
        ),
        (
            None,
            {"base_model.model.lm_head.lora_A.weight": np.zeros((8, 32), np.float32)},
            "the output head",
        ),
        (
            None,
            {"base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight": np.zeros((8, 32))},
            "routed experts",
        ),
        ({"layers_to_transform": [1]}, None, "outside layers_to_transform"),
    ],
)
def test_bad_adapters_are_refused_by_name(tmp_path, config, tensors, message):
    path = _adapter_copy(tmp_path, config=config, tensors=tensors)
    with pytest.raises(AdapterError, match=message):
        mtp_jax.load(base_of(LLAMA_ADAPTERS[0]), "float32", lora_adapters={"bad": path})


def test_refusals_that_leave_the_model_as_it_was(llama, tmp_path):
    before = {k: np.asarray(v) for k, v in _flat(llama.params["lora"]).items()}
    # a layer the base model does not have
    extra = {
        "base_model.model.model.layers.7.self_attn.q_proj.lora_" + ab + ".weight": v
        for ab, v in (("A", np.zeros((8, 32), np.float32)), ("B", np.zeros((64, 8), np.float32)))
    }
    with pytest.raises(AdapterError, match="the base model has 3 layers"):
        llama.load_lora("deep", _adapter_copy(tmp_path, tensors=extra))
    # an adapter for another model (Qwen3's head_dim 16 projections)
    with pytest.raises(AdapterError, match="do not fit the base model"):
        llama.load_lora("qwen3", os.path.join(LORA, "qwen3_qkv_r2"))
    # rank above max_lora_rank (16 here: the fixtures' largest is 8)
    assert llama.lora.max_lora_rank == 16
    with pytest.raises(AdapterError, match="above max_lora_rank 16"):
        llama.load_lora("wide", _wide(tmp_path))
    with pytest.raises(ValueError, match="loaded already"):
        llama.load_lora(LLAMA_ADAPTERS[0], os.path.join(LORA, LLAMA_ADAPTERS[0]))
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        llama.unload_lora("nope")
    assert set(llama.loras) == set(LLAMA_ADAPTERS)
    after = {k: np.asarray(v) for k, v in _flat(llama.params["lora"]).items()}
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing half-loaded


def _wide(tmp_path) -> str:
    """llama_attn_r8 padded to rank 32 (zeros): above the model's max_lora_rank."""
    src = SafetensorsFile(os.path.join(LORA, LLAMA_ADAPTERS[0], "adapter_model.safetensors"))
    values = {}
    for key in src.keys():
        x = src.get(key)
        values[key] = np.pad(x, ((0, 24), (0, 0))) if ".lora_A." in key else np.pad(x, ((0, 0), (0, 24)))
    src.close()
    return _adapter_copy(tmp_path / "wide", config={"r": 32, "lora_alpha": 64}, tensors=values)


def _flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def test_requests_naming_adapters_are_checked(llama):
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'; loaded: llama_all"):
        llama.generate([[5, 6]], max_new_tokens=2, lora="nope")
    with pytest.raises(InvalidRequestError, match="lora has 1 values for 2 prompts"):
        llama.generate([[5, 6], [7]], max_new_tokens=2, lora=["x"])
    plain = mtp_jax.load(base_of(LLAMA_ADAPTERS[0]), "float32")
    with pytest.raises(InvalidRequestError, match="the model has none"):
        plain.generate([[5, 6]], max_new_tokens=2, lora="x")
    with pytest.raises(ValueError, match="no LoRA slots"):
        plain.load_lora("x", os.path.join(LORA, LLAMA_ADAPTERS[0]))
    with pytest.raises(ValueError, match="all 1 LoRA slots are taken"):
        one = mtp_jax.load(
            base_of(LLAMA_ADAPTERS[0]), "float32", lora_adapters={"a": os.path.join(LORA, LLAMA_ADAPTERS[0])}
        )
        one.load_lora("b", os.path.join(LORA, LLAMA_ADAPTERS[1]))


def test_read_adapter_reads_the_peft_settings():
    adapter = read_adapter(os.path.join(LORA, "llama_all_rslora_patterns"))
    cfg = adapter.config
    assert cfg.use_rslora and cfg.layers_to_transform == (0, 2)
    # rsLoRA: alpha / sqrt(r), r and alpha from the patterns where they match the module's end
    q = adapter.weights[(0, "self_attn.q_proj")]
    o = adapter.weights[(2, "self_attn.o_proj")]
    down = adapter.weights[(0, "mlp.down_proj")]
    assert q[0].shape == (4, 32) and q[2] == pytest.approx(8 / 2)
    assert o[0].shape[0] == 2 and o[2] == pytest.approx(8 / np.sqrt(2))
    assert down[0].shape[0] == 6 and down[2] == pytest.approx(3 / np.sqrt(6))
    assert {layer for layer, _ in adapter.weights} == {0, 2}
    # a path object is kept as a string: it goes into /v1/models and the multi-process replay (JSON)
    from pathlib import Path

    assert read_adapter(Path(LORA) / "llama_attn_r8").path == os.path.join(LORA, "llama_attn_r8")


def write_random_adapter(
    path, model, r: int, modules: list[str], seed: int, alpha: float | None = None
) -> str:
    """A PEFT LoRA adapter directory for ``model`` (a loaded model) with random A and B on every
    layer's ``modules`` (the last part of hub names, e.g. "q_proj"), in the layout peft writes."""
    from mtp_jax.synthetic import write_lora_adapter

    return write_lora_adapter(path, model.config, r, modules, seed, alpha)


def merged_checkpoint(base: str, adapter: str, dst) -> str:
    """``base`` (a hub-layout directory) with ``adapter``'s products merged into its weights:
    W + s B A, computed here in float64 from the files (an independent reference)."""
    weights = SafetensorsFile(os.path.join(base, "model.safetensors"))
    tensors = {k: np.asarray(weights.get(k), np.float64) for k in weights.keys()}
    weights.close()
    for (layer, module), (a, b, s) in read_adapter(adapter).weights.items():
        key = f"model.layers.{layer}.{module}.weight"
        tensors[key] = tensors[key] + s * (b.astype(np.float64) @ a.astype(np.float64))
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(base, "config.json"), dst)
    save_safetensors(
        os.path.join(dst, "model.safetensors"), {k: v.astype(np.float32) for k, v in tensors.items()}
    )
    return str(dst)


def test_deepseek_dense_and_shared_expert_mlps_equal_the_merged_weights(tmp_path):
    """DeepSeek-V3's dense-layer MLP and shared experts (peft targets the fused routed experts when
    given these names, so the reference is the adapter merged into the weights) plus its MLA."""
    base = os.path.join(FIXTURES, "parity", "nogroup_dense2")  # 2 dense layers, 2 shared experts
    plain = mtp_jax.load(base, "float32")
    modules = ["gate_proj", "up_proj", "down_proj", "q_b_proj", "kv_b_proj"]
    adapter = write_random_adapter(tmp_path / "mlp", plain, 6, modules, seed=7)
    sites = {m for (_, m) in read_adapter(adapter).weights}
    assert {"mlp.gate_proj", "mlp.shared_experts.down_proj", "self_attn.kv_b_proj"} <= sites
    model = mtp_jax.load(base, "float32", lora_adapters={"mlp": adapter}, page_size=4)
    merged = mtp_jax.load(merged_checkpoint(base, adapter, tmp_path / "merged"), "float32", page_size=4)
    ids = np.random.default_rng(0).integers(3, plain.config.vocab_size, (2, 10)).astype(np.int32)
    want = merged.logits(ids)
    got = model.logits(ids, lora="mlp")
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(want - plain.logits(ids)).max() > 1e-2 * np.abs(want).max()
    prompts = [[int(t) for t in row[:5]] for row in ids]
    greedy = merged.generate(prompts, max_new_tokens=8, ignore_eos=True).tokens
    assert model.generate(prompts, max_new_tokens=8, ignore_eos=True, lora="mlp").tokens == greedy


def test_deepseek_mtp_speculation_with_an_adapter_is_lossless(tmp_path):
    """The embedded DeepSeek-V3 with its MTP draft (base weights) and an adapter on the target:
    greedy speculation equals plain decoding with the adapter, and drafts are still accepted."""
    from tests.conftest import EMBEDDED_MODEL

    plain = mtp_jax.load(EMBEDDED_MODEL, "float32")
    adapter = write_random_adapter(
        tmp_path / "a", plain, 4, ["q_a_proj", "kv_b_proj", "o_proj", "up_proj"], seed=3
    )
    model = mtp_jax.load(EMBEDDED_MODEL, "float32", lora_adapters={"a": adapter}, page_size=4)
    prompts = [[0, 17, 42, 9], [0, 5, 5, 5, 5]]
    kw = dict(max_new_tokens=12, ignore_eos=True, lora=["a", None])
    want = model.generate(prompts, **kw).tokens
    assert want[0] != plain.generate(prompts[:1], max_new_tokens=12, ignore_eos=True).tokens[0]
    assert want[1] == plain.generate(prompts[1:], max_new_tokens=12, ignore_eos=True).tokens[0]
    spec = model.generate(prompts, draft="mtp", num_speculative_tokens=3, **kw)
    assert spec.tokens == want and spec.stats["num_accepted_tokens"] > 0


def test_eagle3_dflash_and_draft_model_speculation_with_an_adapter_is_lossless(tmp_path):
    """The embedded tiny Llama with its shipped EAGLE-3, DFlash and draft-model drafts (base
    weights) and an adapter on the target: greedy speculation equals plain decoding with the
    adapter, row by row beside a row without one, and the drafts are still accepted."""
    from tokenizers import Tokenizer

    path = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
    plain = mtp_jax.load(path, "float32")
    adapter = write_random_adapter(
        tmp_path / "a", plain, 8, ["q_proj", "v_proj", "down_proj"], seed=4, alpha=8
    )
    target = mtp_jax.load(path, "float32", lora_adapters={"a": adapter})
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in ("def read_config(path):\n", "import os\nimport sys\n")]
    kw = dict(max_new_tokens=24, ignore_eos=True, lora=["a", None])
    want = target.generate(prompts, **kw).tokens
    assert want[0] != plain.generate(prompts[:1], max_new_tokens=24, ignore_eos=True).tokens[0]
    for method, suffix in (("eagle3", "eagle3"), ("dflash", "dflash"), ("draft_model", "draft")):
        model = target.with_draft(f"{path}-{suffix}")
        assert model.loras == ("a",)  # the adapters come along
        out = model.generate(prompts, draft=method, num_speculative_tokens=3, **kw)
        assert out.tokens == want and out.stats["num_accepted_tokens"] > 0, method


# Tensor-parallel Llama (data x tensor) and expert-parallel DeepSeek-V3 (data x expert) on 8 simulated
# devices, in a background child (tests/conftest.py's ``child``): logits and greedy generation of a
# mixed batch (two adapters and none) equal one device's, with the stacks split as their sites say.
SHARDED_CHILD = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, numpy as np
assert len(jax.devices()) == 8
import mtp_jax
lora, fixtures = sys.argv[1], sys.argv[2]
cases = [
    ("parity_llama/llama3_gqa42", ["llama_attn_r8", "llama_all_rslora_patterns"], dict(data=2, tensor=4)),
    ("parity/base", ["deepseek_mla_r8"], dict(data=2, expert=4)),
]
for base, names, axes in cases:
    src = os.path.join(fixtures, base)
    adapters = {n: os.path.join(lora, n) for n in names}
    one = mtp_jax.load(src, "float32", lora_adapters=adapters, max_loras=2, page_size=4)
    mesh = mtp_jax.make_mesh(**axes)
    split = mtp_jax.load(src, "float32", lora_adapters=adapters, max_loras=2, page_size=4, mesh=mesh)
    ids = np.load(os.path.join(lora, names[0], "reference.npz"))["input_ids"]
    rows = np.concatenate([ids, ids])
    per_row = [names[0], None, names[-1], names[0]]
    want, got = one.logits(rows, lora=per_row), split.logits(rows, lora=per_row)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (base, np.abs(got - want).max())
    prompts = [[int(t) for t in r[:6]] for r in rows]
    kw = dict(max_new_tokens=8, ignore_eos=True, lora=per_row)
    assert split.generate(prompts, **kw).tokens == one.generate(prompts, **kw).tokens, base
    if "tensor" in axes:  # q's adapter B is split with q's heads
        b = split.params["lora"]["layers"]["attn"]["q"]["b"]
        assert b.sharding.shard_shape(b.shape)[3] == b.shape[3] // axes["tensor"], b.sharding
print("LORA-SHARDED-OK")
"""


@pytest.mark.child(SHARDED_CHILD, LORA, FIXTURES)
def test_sharded_adapters_equal_one_device(child_output):
    assert "LORA-SHARDED-OK" in child_output


def test_per_layer_buffers_hold_the_adapters_per_layer_too(llama):
    """With per-layer weight buffers (real models on one device) the adapters are per-layer buffers
    too (sliced out of a stack they would be copied every step): same logits, same loading."""
    ref = reference(LLAMA_ADAPTERS[0])
    adapters = {name: os.path.join(LORA, name) for name in LLAMA_ADAPTERS}
    split = mtp_jax.load(
        base_of(LLAMA_ADAPTERS[0]), "float32", lora_adapters=adapters, max_loras=3, layer_buffers=True
    )
    assert split.layer_buffers and isinstance(split.params["lora"]["layers"], tuple)
    names = [LLAMA_ADAPTERS[0], LLAMA_ADAPTERS[1]]
    np.testing.assert_allclose(
        split.logits(ref["input_ids"], lora=names),
        llama.logits(ref["input_ids"], lora=names),
        rtol=1e-5,
        atol=1e-5,
    )
    split.unload_lora(LLAMA_ADAPTERS[1])
    np.testing.assert_allclose(
        split.logits(ref["input_ids"][1:]), llama.logits(ref["input_ids"][1:]), rtol=1e-5, atol=1e-5
    )
    split.load_lora("again", os.path.join(LORA, LLAMA_ADAPTERS[1]))
    np.testing.assert_allclose(
        split.logits(ref["input_ids"], lora=[LLAMA_ADAPTERS[0], "again"]),
        llama.logits(ref["input_ids"], lora=names),
        rtol=1e-5,
        atol=1e-5,
    )
