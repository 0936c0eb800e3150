"""Parameter / byte / memory estimates from config.json alone, checked against an independent
enumeration (``hub_tensors``) on tiny configs and against the published DeepSeek-V3 figures."""

from __future__ import annotations

import copy
import math
import re

import pytest

from mtp_jax.estimate import (
    count_parameters,
    kv_cache_bytes_per_token,
    per_device_memory,
    weight_bytes,
)
from mtp_jax.estimate import format_report as report
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
from tests.conftest import DEEPSEEK_V3_CONFIG, TINY_CONFIG

DEEPSEEK_V3 = DEEPSEEK_V3_CONFIG

# Tiny variants: q_lora None, tied embeddings, 0/2 shared experts, first_k_dense 0..all, MTP 0/1/2.
VARIANTS = {
    "default": {},
    "no_q_lora_tied": {"q_lora_rank": None, "tie_word_embeddings": True},
    "no_shared_no_dense_no_mtp": {
        "n_shared_experts": 0,
        "first_k_dense_replace": 0,
        "num_nextn_predict_layers": 0,
    },
    "two_shared_two_dense_two_mtp": {
        "n_shared_experts": 2,
        "first_k_dense_replace": 2,
        "num_nextn_predict_layers": 2,
    },
    "all_dense_tied_mtp": {"first_k_dense_replace": 3, "tie_word_embeddings": True, "q_lora_rank": None},
}

_UNQUANTISED = re.compile(
    r"(embed_tokens|lm_head|shared_head\.head|eh_proj|mlp\.gate)\.weight$|norm\.weight$|e_score_correction_bias$"
)
_MTP_DUPLICATE = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


def _cfg(**overrides) -> DeepseekV3Config:
    raw = copy.deepcopy(TINY_CONFIG)
    raw.update(overrides)
    return DeepseekV3Config.from_dict(raw)


@pytest.fixture(scope="module")
def v3() -> DeepseekV3Config:
    return DeepseekV3Config.from_dict(DEEPSEEK_V3)


def _brute_force_fp8(cfg: DeepseekV3Config, block: tuple[int, int], *, hub_layout: bool) -> dict[str, int]:
    """Bytes by dtype from the hub key list: quantised weights 1 byte + ceil-shaped float32 scales."""
    out = {"float8_e4m3fn": 0, "bfloat16": 0, "float32": 0}
    for key, x in hub_tensors(cfg).items():
        if not hub_layout and _MTP_DUPLICATE.match(key):
            continue
        if key.endswith("e_score_correction_bias") or (not hub_layout and key.endswith("mlp.gate.weight")):
            out["float32"] += 4 * x.size  # the bias always; the router gate as our loader holds it
        elif _UNQUANTISED.search(key) or (not hub_layout and key.endswith("kv_b_proj.weight")):
            out["bfloat16"] += 2 * x.size
        else:
            assert x.ndim == 2, key
            out["float8_e4m3fn"] += x.size
            out["float32"] += 4 * math.ceil(x.shape[0] / block[0]) * math.ceil(x.shape[1] / block[1])
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_counts_match_hub_tensors(name):
    cfg = _cfg(**VARIANTS[name])
    tensors = hub_tensors(cfg)
    pc = count_parameters(cfg)
    assert pc.total + pc.mtp_duplicates == pc.hub_total == sum(x.size for x in tensors.values())
    assert pc.mtp_duplicates == 2 * cfg.num_nextn_predict_layers * cfg.vocab_size * cfg.hidden_size
    mtp_keys = {
        k for k in tensors if k.startswith("model.layers.") and int(k.split(".")[2]) >= cfg.num_hidden_layers
    }
    assert pc.mtp + pc.mtp_duplicates == sum(tensors[k].size for k in mtp_keys)
    assert pc.main == sum(x.size for k, x in tensors.items() if k not in mtp_keys)
    assert pc.lm_head == (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    assert pc.shared_experts == (
        3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.n_shared_experts * cfg.num_moe_layers
    )
    routed = sum(x.size for k, x in tensors.items() if ".experts." in k and k not in mtp_keys)
    assert pc.routed_experts == routed
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert pc.active_per_token == pc.main - routed + per_expert * cfg.num_experts_per_tok * cfg.num_moe_layers

    # fp32: 4 bytes each, MTP duplicates stored once; bf16: 2 bytes except the float32 routers
    # (bias and gate, as loaded; the hub's gate is bf16).
    assert weight_bytes(cfg, "fp32") == {"float32": 4 * pc.total}
    assert weight_bytes(cfg, "fp32", hub_layout=True) == {"float32": 4 * pc.hub_total}
    bias = cfg.n_routed_experts * (cfg.num_moe_layers + cfg.num_nextn_predict_layers)
    routers = bias * (1 + cfg.hidden_size)
    expected_bf16 = {"bfloat16": 2 * (pc.total - routers)} | ({"float32": 4 * routers} if bias else {})
    assert weight_bytes(cfg, "bf16") == expected_bf16
    hub_bf16 = {"bfloat16": 2 * (pc.hub_total - bias)} | ({"float32": 4 * bias} if bias else {})
    assert weight_bytes(cfg, "bf16", hub_layout=True) == hub_bf16


@pytest.mark.parametrize("block", [(128, 128), (16, 12), (5, 7)])
@pytest.mark.parametrize("name", ["default", "no_q_lora_tied", "two_shared_two_dense_two_mtp"])
def test_fp8_bytes_match_brute_force(name, block):
    raw = copy.deepcopy(TINY_CONFIG) | VARIANTS[name]
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    cfg = DeepseekV3Config.from_dict(raw)
    assert weight_bytes(cfg, "fp8", hub_layout=True) == _brute_force_fp8(cfg, block, hub_layout=True)
    assert weight_bytes(cfg, "fp8") == _brute_force_fp8(cfg, block, hub_layout=False)


def test_fp8_default_block_without_quantization_config():
    cfg = _cfg()
    assert cfg.quantization_config is None
    assert weight_bytes(cfg, "fp8") == _brute_force_fp8(cfg, (128, 128), hub_layout=False)


def test_bad_weights_format():
    with pytest.raises(ValueError, match="bf16, fp32, fp8"):
        weight_bytes(_cfg(), "int4")


def test_deepseek_v3_published_parameter_counts(v3):
    pc = count_parameters(v3)
    print(pc)
    assert abs(pc.main / 671e9 - 1) < 0.005
    # The published 14B MTP (671B + 14B = 685B) includes the MTP layer's own copies of the embedding
    # and lm_head: 13.46B with them, 11.61B without.
    assert abs((pc.mtp + pc.mtp_duplicates) / 14e9 - 1) < 0.05
    assert abs(pc.mtp / 14e9 - 1) > 0.1
    assert abs(pc.hub_total / 685e9 - 1) < 0.005
    assert abs(pc.active_per_token / 37e9 - 1) < 0.03


def test_deepseek_v3_fp8_bytes_match_the_hub_checkpoint(v3):
    hub = weight_bytes(v3, "fp8", hub_layout=True)
    loaded = weight_bytes(v3, "fp8")
    print({k: f"{v / 1e9:.2f} GB" for k, v in hub.items()}, f"hub {sum(hub.values()) / 1e9:.2f} GB")
    print({k: f"{v / 1e9:.2f} GB" for k, v in loaded.items()}, f"loaded {sum(loaded.values()) / 1e9:.2f} GB")
    # The hub repo: 163 shards, about 688 GB (641.29 GiB of tensors).
    assert abs(sum(hub.values()) / 688e9 - 1) < 0.03
    assert abs(sum(loaded.values()) / 688e9 - 1) < 0.03
    # A public inventory of the DeepSeek-R1 files (same layout: 91,991 tensors) counts 684,531,386,000
    # elements, weight_scale_inv tensors included.
    elements = hub["float8_e4m3fn"] + hub["bfloat16"] // 2 + hub["float32"] // 4
    assert elements == 684_531_386_000
    # Loaded: kv_b_proj (62 layers) is bf16 without scales; the MTP embed/head copies are dropped;
    # the router gates (58 MoE layers + MTP) are float32.
    kv_b = 62 * 128 * (128 + 128) * 512
    kv_b_scales = 62 * (128 * 256 // 128) * (512 // 128)
    gates = 59 * 256 * 7168
    assert loaded["float8_e4m3fn"] == hub["float8_e4m3fn"] - kv_b
    assert loaded["bfloat16"] == hub["bfloat16"] + 2 * kv_b - 2 * 2 * 129280 * 7168 - 2 * gates
    assert loaded["float32"] == hub["float32"] - 4 * kv_b_scales + 4 * gates


def test_kv_cache_bytes_per_token(v3):
    assert kv_cache_bytes_per_token(v3) == (512 + 64) * 62 * 2
    assert kv_cache_bytes_per_token(v3, dtype_bytes=1, include_mtp=False) == 576 * 61
    assert kv_cache_bytes_per_token(_cfg(num_nextn_predict_layers=0), 4) == (16 + 4) * 3 * 4


def test_per_device_memory_deepseek_v3(v3):
    mem = per_device_memory(v3, "fp8", {"data": 1, "expert": 8}, 1_000_000)
    loaded = sum(weight_bytes(v3, "fp8").values())
    print(mem, f"total {mem.total_bytes / 1e9:.2f} GB")
    assert mem.devices == 8 and mem.experts_per_device == 32
    assert mem.param_bytes + 8 * mem.expert_bytes == loaded
    # Routed experts (59 MoE layers with MTP, fp8 + scales) split 8 ways; everything else replicated.
    experts = 59 * 256 * 3 * 7168 * 2048 * (1 + 4 / (128 * 128))
    assert mem.expert_bytes == pytest.approx(experts / 8, rel=1e-6)
    assert mem.kv_tokens_per_device == 125_000
    assert mem.kv_bytes == 125_000 * 576 * 62 * 2
    assert mem.total_bytes == mem.param_bytes + mem.expert_bytes + mem.kv_bytes < 141e9
    assert mem.kv_tokens_that_fit(141 * 10**9) * mem.kv_bytes_per_token <= 141e9 - mem.weight_bytes
    # More data-parallel replicas split the KV cache further but replicate the rest.
    mem2 = per_device_memory(v3, "fp8", {"data": 2, "expert": 8, "tensor": 1}, 1_000_000)
    assert (mem2.param_bytes, mem2.expert_bytes, mem2.kv_tokens_per_device) == (
        mem.param_bytes,
        mem.expert_bytes,
        62_500,
    )
    # bf16 experts without MTP on one device hold everything (float32 routers: 2 more bytes each).
    one = per_device_memory(v3, "bf16", {}, 10, include_mtp=False)
    assert (
        one.devices == 1
        and one.param_bytes + one.expert_bytes == 2 * count_parameters(v3).main + 58 * 256 * (1 + 7168) * 2
    )


def test_per_device_memory_errors(v3):
    with pytest.raises(ValueError, match=r"'expert'=7 does not divide n_routed_experts=256"):
        per_device_memory(v3, "fp8", {"data": 1, "expert": 7}, 1000)
    with pytest.raises(ValueError, match=r"'tensor'=2 is not supported"):
        per_device_memory(v3, "fp8", {"expert": 8, "tensor": 2}, 1000)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        per_device_memory(v3, "fp8", {"pipeline": 2}, 1000)
    with pytest.raises(ValueError, match="positive integer"):
        per_device_memory(v3, "fp8", {"data": 0}, 1000)
    with pytest.raises(ValueError, match="kv_tokens"):
        per_device_memory(v3, "fp8", {}, -1)


def test_format_report_mentions_key_numbers(v3):
    text = report(v3, "fp8", {"data": 1, "expert": 8}, 1_000_000, 141)
    print(text)
    for needle in (
        "deepseek_v3",
        "61 (3 dense + 58 MoE) + 1 MTP",
        "256 routed (8 per token",
        "128 heads",
        "vocab 129280",
        "671.03B",  # main
        "11.61B",  # MTP
        "37.55B",  # active per token
        "653.91B",  # routed experts
        "float8_e4m3fn",
        "688.57 GB",  # hub files
        "686.12 GB",  # as loaded
        "32 routed experts per device",
        "83.17 GB",  # experts per device
        "125000 tokens",
        "fits",
        "KV tokens that fit",
    ):
        assert needle in text, needle
    small = report(v3, "fp8", {"expert": 8}, 1_000_000, 80)
    assert "does NOT fit" in small and "no room for KV cache" in small
    tiny = report(_cfg(q_lora_rank=None, tie_word_embeddings=True), "bf16", {}, 64)
    assert "no q_lora" in tiny and "tied" in tiny and "Device memory" not in tiny


# --- Llama 3 ----------------------------------------------------------------------------------------
LLAMA_TINY = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 6,
}


@pytest.mark.parametrize("tied", [False, True])
def test_llama_counts_and_bytes_match_hub_tensors(tied):
    from mtp_jax.targets.llama.config import Llama3Config
    from mtp_jax.targets.llama.synthetic import llama_hub_tensors

    cfg = Llama3Config.from_dict({**LLAMA_TINY, "tie_word_embeddings": tied})
    tensors = llama_hub_tensors(cfg)
    pc = count_parameters(cfg)
    assert pc.total == pc.hub_total == pc.main == pc.active_per_token == sum(x.size for x in tensors.values())
    assert pc.lm_head == (0 if tied else 96 * 32)
    assert pc.routed_experts == pc.routers == pc.mtp == 0
    assert weight_bytes(cfg, "bf16") == {"bfloat16": 2 * pc.total}
    assert weight_bytes(cfg, "fp32") == {"float32": 4 * pc.total}
    with pytest.raises(ValueError, match="Llama 3 checkpoints are dense"):
        weight_bytes(cfg, "fp8")
    assert kv_cache_bytes_per_token(cfg, 2) == 2 * 2 * 6 * 3 * 2  # K and V, 2 KV heads, 3 layers


def test_llama_per_device_memory_splits_over_tensor():
    from mtp_jax.targets.llama.config import Llama3Config

    cfg = Llama3Config.from_dict(LLAMA_TINY)  # 8 heads, 2 KV heads, head_dim 6, untied
    d, f, v, n = 32, 48, 96, 3
    q_o, kv, mlp = 2 * 8 * 6 * d, 2 * 2 * 6 * d, 3 * d * f
    one = per_device_memory(cfg, "bf16", {}, 100)
    assert one.expert_bytes == 2 * (n * (q_o + kv + mlp) + v * d)  # every split weight, whole
    assert one.param_bytes == 2 * (v * d + (2 * n + 1) * d)  # embedding and norms replicated
    two = per_device_memory(cfg, "bf16", {"data": 2, "tensor": 2}, 100)
    assert two.expert_bytes == one.expert_bytes // 2  # KV heads divide: everything split in two
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2 and two.kv_tokens_per_device == 50
    four = per_device_memory(cfg, "bf16", {"tensor": 4}, 100)  # 2 KV heads: replicated over 4
    assert four.expert_bytes == 2 * (n * (q_o + mlp) + v * d) // 4 + 2 * n * kv
    assert four.kv_bytes_per_token == one.kv_bytes_per_token and four.kv_tokens_per_device == 100
    with pytest.raises(ValueError, match="Llama has no experts"):
        per_device_memory(cfg, "bf16", {"expert": 2}, 0)
    with pytest.raises(ValueError, match="does not divide the 8 attention heads"):
        per_device_memory(cfg, "bf16", {"tensor": 3}, 0)


@pytest.mark.parametrize(("name", "published"), [("8b", 8.03e9), ("70b", 70.6e9), ("405b", 405.9e9)])
def test_llama_3_1_published_parameter_counts(name, published):
    import os

    from mtp_jax.config import load_config
    from tests.conftest import REPO

    cfg = load_config(os.path.join(REPO, "configs", f"llama-3.1-{name}.json"))
    assert abs(count_parameters(cfg).total / published - 1) < 0.001
    text = report(cfg, "bf16", {"tensor": 8}, 10**6, 141)
    assert "Llama 3" in text and "tensor-split params" in text and "GQA" in text
