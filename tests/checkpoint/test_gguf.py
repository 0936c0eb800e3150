"""GGUF checkpoints: tensors of every supported type against the ``gguf`` package's own
dequantisation, a Llama GGUF written in llama.cpp's layout against the same weights from
safetensors (logits, tokenizer), and malformed files refused by name."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.gguf import SUPPORTED_TYPES, GGUFCheckpoint
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.errors import CheckpointError, ConfigError
from mtp_jax.targets.llama.gguf import llama3_rope_divisors, rope_scaling
from mtp_jax.text import TextCodec
from tests.conftest import REPO, require_extra

gguf = require_extra("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

TINY_LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")

# llama.cpp tensor names of the hub names a Llama layer has.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's two rope halves interleaved. Written
    here to make files of many tensor types; that our reader undoes what llama.cpp itself writes is
    proven on files its converter made (tests/checkpoint/test_gguf_llamacpp.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(key: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if key in fixed:
        return fixed[key]
    _, _, i, rest = key.split(".", 3)
    return f"blk.{i}.{LAYER_NAMES[rest]}"


def write_llama_gguf(src: str, path: str, kind: str = "F32", *, add_bos: bool = True, arch: str = "llama"):
    """A hub Llama-family checkpoint as llama.cpp's converter writes it: metadata, tokenizer (when
    the checkpoint has one), q/k rows permuted for ``llama`` (not for ``qwen2`` / ``qwen3``), 2-D
    weights in ``kind`` (norms and biases stay F32), llama3 rope scaling as rope_freqs."""
    cfg = json.loads(Path(src, "config.json").read_text())
    w = gguf.GGUFWriter(path, arch)
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // h
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if os.path.isfile(os.path.join(src, "tokenizer.json")):
        write_tokenizer(w, src, cfg, add_bos)
    scaling = cfg.get("rope_scaling")
    if scaling:
        divisors = llama3_rope_divisors(
            hd,
            cfg["rope_theta"],
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
            scaling["original_max_position_embeddings"],
        )
        w.add_tensor("rope_freqs.weight", divisors.astype(np.float32))
    reader = CheckpointReader(src)
    for key in reader.keys():
        x = np.asarray(reader.get(key), np.float32)
        if key.endswith("q_proj.weight") and arch == "llama":
            x = llama_cpp_permute(x, h)
        elif key.endswith("k_proj.weight") and arch == "llama":
            x = llama_cpp_permute(x, kv)
        if x.ndim == 2 and kind != "F32":
            q = quantize(x, T[kind])
            w.add_tensor(gguf_name(key), q, raw_shape=q.shape, raw_dtype=T[kind])
        else:
            w.add_tensor(gguf_name(key), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tokenizer(w, src: str, cfg: dict, add_bos: bool) -> None:
    tok = json.loads(Path(src, "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv_: kv_[1])
    special = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(add_bos)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_llama_gguf(TINY_LLAMA, str(tmp_path_factory.mktemp("gguf") / "tiny-llama3.gguf"))


def raw_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Bytes of ``rows`` x ``cols`` values of a block type: quantised by the gguf package where it
    can, else random blocks whose float16 scales are set to sane values."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind not in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize(x, T[kind])
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.full((rows, cols // block), 0.01, np.float16).view(np.uint8).reshape(rows, -1, 2)
    if kind == "Q6_K":  # ... ql, qh, int8 scales, then d
        data[..., -2:] = scale
    else:  # d, dmin first
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_every_supported_type_reads_as_the_gguf_package_dequantises_it(kind, tmp_path):
    rng = np.random.default_rng(0)
    rows, cols = 3, 512
    raw = raw_blocks(kind, rows, cols, rng)
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    if kind in ("F32", "F16"):
        w.add_tensor("blk.0.ffn_up.weight", raw)
    else:
        w.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GGUFCheckpoint(path)
    assert ckpt.tensor_type("blk.0.ffn_up.weight") == kind
    tensors = ckpt.tensors()
    got = np.asarray(tensors.get("model.layers.0.mlp.up_proj.weight"), np.float32)
    assert got.shape == (rows, cols) == tensors.shape("model.layers.0.mlp.up_proj.weight")
    want = raw.astype(np.float32) if kind in ("F32", "F16") else dequantize(raw, T[kind])
    np.testing.assert_array_equal(got, want.reshape(rows, cols))
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_our_header_reader_equals_the_gguf_packages(tiny_gguf, tmp_path):
    """mtp_jax.checkpoint.gguf_file (one pass over the header; the gguf package's reader took 16.7 s
    over Gemma 3's vocabulary) gives the gguf package's metadata and tensor bytes, on a file with
    a tokenizer, every scalar and array value type, and tensors of several types."""
    from mtp_jax.checkpoint.gguf_file import read_gguf

    path = str(tmp_path / "kinds.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("x.u8", 7)
    w.add_int16("x.i16", -3)
    w.add_uint64("x.u64", 2**40)
    w.add_float64("x.f64", 0.1)
    w.add_bool("x.bool", True)
    w.add_array("x.ints", [1, -2, 3])
    w.add_array("x.floats", [0.5, 1.5])
    w.add_array("x.strings", ["a", "", "\u2581b", "東京"])
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 32)).astype(np.float16))
    q8 = raw_blocks("Q8_0", 2, 64, rng)
    w.add_tensor("b", q8, raw_shape=q8.shape, raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (tiny_gguf, path):
        reader = gguf.GGUFReader(file)
        meta, tensors = read_gguf(file)
        assert meta == {
            f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")
        }
        assert [t.name for t in reader.tensors] == list(tensors)
        for t in reader.tensors:
            ours = tensors[t.name].data()
            assert (ours.shape, ours.dtype, tensors[t.name].tensor_type) == (
                t.data.shape,
                t.data.dtype,
                t.tensor_type,
            )
            np.testing.assert_array_equal(ours, t.data)


def test_unsupported_tensor_type_is_refused_by_name(tmp_path):
    path = str(tmp_path / "q2k.gguf")
    w = gguf.GGUFWriter(path, "llama")
    block, size = gguf.GGML_QUANT_SIZES[T.Q2_K]
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, size), np.uint8), raw_shape=(2, size), raw_dtype=T.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        CheckpointError, match="'blk.0.ffn_up.weight' has GGUF type Q2_K, which is not supported"
    ):
        GGUFCheckpoint(path).tensors().get("model.layers.0.mlp.up_proj.weight")


def test_llama_gguf_matches_the_same_weights_from_safetensors(tiny_gguf):
    """Logits through the GGUF (q/k rows un-permuted, rope scaling recovered from rope_freqs,
    config from metadata) equal those of the hub checkpoint the GGUF was written from."""
    ckpt = GGUFCheckpoint(tiny_gguf)
    raw = json.loads(Path(TINY_LLAMA, "config.json").read_text())
    cfg = ckpt.hf_config()
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_theta", "vocab_size"):
        assert cfg[key] == raw[key], key
    assert cfg["rope_scaling"] == raw["rope_scaling"]
    assert cfg["tie_word_embeddings"] is False
    a = mtp_jax.load(TINY_LLAMA, "float32")
    b = mtp_jax.load(tiny_gguf, "float32")
    assert b.config.rope_scaling == a.config.rope_scaling and b.eos_token_ids == a.eos_token_ids
    ids = [[0, 5, 17, 300, 42, 7, 1000, 3, 9]]
    np.testing.assert_allclose(b.logits(ids), a.logits(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2_bias_tied", "qwen3_qk_norm"])
def test_qwen_ggufs_match_the_same_weights_from_safetensors(name, tmp_path):
    """Qwen2 (q/k/v biases, tied) and Qwen3 (q/k norms, explicit head_dim) GGUFs: the config from the
    metadata, the biases and norms under their llama.cpp names, the q/k rows in hub order."""
    src = os.path.join(REPO, "tests", "fixtures", "parity_llama", name)
    arch = name.split("_")[0]
    path = write_llama_gguf(src, str(tmp_path / f"{name}.gguf"), arch=arch)
    a = mtp_jax.load(src, "float32")
    b = mtp_jax.load(path, "float32", strict=True)
    assert type(b.config) is type(a.config) and b.config.model_type == arch
    assert (b.config.head_dim, b.config.tie_word_embeddings) == (
        a.config.head_dim,
        a.config.tie_word_embeddings,
    )
    ids = [[3, 5, 17, 100, 42, 7, 10, 3, 9]]
    np.testing.assert_allclose(b.logits(ids), a.logits(ids), rtol=1e-5, atol=1e-5)


def test_gguf_tokenizer_equals_the_checkpoints_and_keeps_its_bos_rule(tiny_gguf, tmp_path):
    hub = TextCodec.from_dir(TINY_LLAMA)
    ours = TextCodec.for_path(tiny_gguf)
    texts = ["def main():\n    return 42\n", "  leading spaces, émoji 🙂 and digits 12345", "", "<|eos|> x"]
    for text in texts:
        assert ours.encode(text) == hub.encode(text), text
        assert ours.decode(ours.encode(text)) == hub.decode(hub.encode(text))
    assert ours.encode("x")[0] == 0  # tokenizer.ggml.add_bos_token = true
    no_bos = TextCodec.for_path(write_llama_gguf(TINY_LLAMA, str(tmp_path / "nobos.gguf"), add_bos=False))
    assert no_bos.encode("x") == hub.encode("x")[1:]


def test_convert_a_gguf_then_load_it_like_any_converted_checkpoint(tiny_gguf, tmp_path):
    from mtp_jax.checkpoint.convert import convert

    out = str(tmp_path / "converted")
    convert(tiny_gguf, out, progress=False)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    a, b = mtp_jax.load(tiny_gguf, "float32"), mtp_jax.load(out, "float32")
    ids = [[0, 5, 17, 300]]
    np.testing.assert_array_equal(b.logits(ids), a.logits(ids))
    assert b.text.encode("def f(): pass") == a.text.encode("def f(): pass")


@pytest.mark.parametrize("damage", ["truncated", "not_gguf", "architecture", "rope_freqs"])
def test_malformed_gguf_files_are_refused_by_name(damage, tiny_gguf, tmp_path):
    path = tmp_path / "bad.gguf"
    blob = Path(tiny_gguf).read_bytes()
    if damage == "truncated":
        path.write_bytes(blob[: len(blob) - 1000])
        with pytest.raises(CheckpointError, match="truncated"):
            mtp_jax.load(str(path))
    elif damage == "not_gguf":
        path.write_bytes(b"PK\x03\x04" + blob[4:100])
        with pytest.raises(CheckpointError, match="not a GGUF file"):
            GGUFCheckpoint(str(path))
    elif damage == "architecture":
        w = gguf.GGUFWriter(str(path), "gemma2")
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(
            ConfigError,
            match="architecture 'gemma2' is not supported; supported: gemma3, llama, qwen2, qwen3",
        ):
            mtp_jax.load(str(path))
    else:  # rope_freqs that no llama3 scaling produces
        w = gguf.GGUFWriter(str(path), "llama")
        for key, value in (("llama.attention.head_count", 2), ("llama.embedding_length", 8)):
            w.add_uint32(key, value)
        w.add_tensor("rope_freqs.weight", np.asarray([3.7, 1.0], np.float32))  # high frequencies scaled more
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ConfigError, match="rope_freqs tensor matches no llama3 rope scaling"):
            rope_scaling(GGUFCheckpoint(str(path)), 4, 10000.0)


def test_llama3_rope_divisors_follow_the_published_formula():
    """Llama 3.1's scaling (factor 8, low 1, high 4, original 8192) at head dim 128, theta 500000:
    high frequencies unscaled, low ones divided by 8, the band between smoothly interpolated."""
    d = llama3_rope_divisors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    inv = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    wavelen = 2 * math.pi / inv
    assert (d[wavelen < 8192 / 4] == 1).all() and (d[wavelen > 8192] == 8).all()
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    smooth = (8192 / wavelen[mid] - 1) / 3
    np.testing.assert_allclose(1 / d[mid], (1 - smooth) / 8 + smooth)
