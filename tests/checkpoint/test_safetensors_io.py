"""Our safetensors reader/writer against the official ``safetensors`` library, plus corrupt files,
atomic writes and the multi-file CheckpointReader."""

from __future__ import annotations

import json
import os
import re
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_numpy

from mtp_jax.checkpoint import safetensors_io
from mtp_jax.checkpoint.safetensors_io import INDEX_NAME, CheckpointReader, SafetensorsFile, save_safetensors
from mtp_jax.errors import CheckpointError, CheckpointNotFoundError


def _sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f64": rng.standard_normal((4,)),
        "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "i32": rng.integers(-(2**31), 2**31 - 1, (7,), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, (2, 2), dtype=np.int64),
        "i16": rng.integers(-30000, 30000, (5,), dtype=np.int16),
        "i8": rng.integers(-128, 127, (3,), dtype=np.int8),
        "bool": rng.integers(0, 2, (3, 3)).astype(np.bool_),
        "u8": rng.integers(0, 256, (11,), dtype=np.uint8),  # odd byte count: exercises alignment
        "empty": np.zeros((0, 4), np.float32),
        "model.layers.0.self_attn.q_a_proj.weight": rng.standard_normal((6, 2)).astype(np.float32),
    }


def _assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def _no_temp_files(directory) -> bool:
    return not [n for n in os.listdir(directory) if ".tmp-" in n]


# --- interoperability with the official library ------------------------------------------------


def test_our_files_read_by_official_safetensors(tmp_path):
    tensors = _sample_tensors()
    path = tmp_path / "ours.safetensors"
    written = save_safetensors(path, tensors, {"format": "pt", "note": "hello"})
    assert written == os.path.getsize(path)
    # The JSON header is space-padded so the data block starts 8-byte aligned (zero-copy mmap views).
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert header_len % 8 == 0
    loaded = st_numpy.load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        _assert_same(loaded[name], value)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "note": "hello"}


def test_official_files_read_by_us(tmp_path):
    tensors = _sample_tensors()
    path = tmp_path / "official.safetensors"
    st_numpy.save_file(tensors, str(path), metadata={"format": "np"})
    f = SafetensorsFile(path)
    assert sorted(f.keys()) == sorted(tensors)
    assert f.metadata == {"format": "np"}
    for name, value in tensors.items():
        assert name in f
        assert f.shape(name) == value.shape
        assert f.dtype(name) == value.dtype
        _assert_same(f.get(name), value)
    assert "nope" not in f
    with pytest.raises(CheckpointError, match=r"no tensor named 'nope'"):
        f.get("nope")


def test_scalar_tensor_from_official_file(tmp_path):
    path = tmp_path / "scalar.safetensors"
    st_numpy.save_file({"s": np.array(3.5, np.float32)}, str(path))
    got = SafetensorsFile(path).get("s")
    assert got.shape == () and got == np.float32(3.5)


def test_scalar_tensor_round_trips_with_shape_kept(tmp_path):
    path = tmp_path / "scalar.safetensors"
    save_safetensors(path, {"s": np.array(3.5, np.float32)})
    assert st_numpy.load_file(str(path))["s"].shape == ()
    assert SafetensorsFile(path).get("s").shape == ()


def test_empty_tensor_dict_round_trips(tmp_path):
    path = tmp_path / "empty.safetensors"
    save_safetensors(path, {})
    assert st_numpy.load_file(str(path)) == {}
    assert SafetensorsFile(path).keys() == []


def test_non_contiguous_input_is_written_in_logical_order(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"t": base.T, "strided": base[:, ::2], "fortran": np.asfortranarray(base)}
    path = tmp_path / "views.safetensors"
    save_safetensors(path, tensors)
    official = st_numpy.load_file(str(path))
    ours = SafetensorsFile(path)
    for name, value in tensors.items():
        _assert_same(official[name], np.ascontiguousarray(value))
        _assert_same(ours.get(name), np.ascontiguousarray(value))


def test_get_returns_a_fresh_array_and_never_writes_the_file(tmp_path):
    path = tmp_path / "a.safetensors"
    save_safetensors(path, {"a": np.ones(4, np.float32)})
    before = path.read_bytes()
    f = SafetensorsFile(path)
    arr = f.get("a")
    arr[0] = 2.0
    np.testing.assert_array_equal(f.get("a"), np.ones(4, np.float32))
    assert path.read_bytes() == before


def _bf16_and_fp8() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    bf16 = (rng.standard_normal((5, 7)) * 100).astype(ml_dtypes.bfloat16)
    # Every one of the 256 e4m3fn bit patterns (NaNs included), so the check is bit-exact, not numeric.
    fp8 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(16, 16)
    bf16_bits = np.arange(0, 65536, 257, dtype=np.uint16).view(ml_dtypes.bfloat16)
    e5m2 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2)
    return {"bf16": bf16, "bf16_bits": bf16_bits, "fp8": fp8, "e5m2": e5m2}


def test_bf16_and_fp8_round_trip_bit_exact(tmp_path):
    tensors = _bf16_and_fp8()
    path = tmp_path / "low.safetensors"
    save_safetensors(path, tensors)
    header = json.loads(path.read_bytes()[8 : 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert header["bf16"]["dtype"] == "BF16"
    assert header["fp8"]["dtype"] == "F8_E4M3"
    assert header["e5m2"]["dtype"] == "F8_E5M2"
    f = SafetensorsFile(path)
    for name, value in tensors.items():
        got = f.get(name)
        assert got.dtype == value.dtype and got.shape == value.shape
        view = np.uint16 if value.dtype.itemsize == 2 else np.uint8
        np.testing.assert_array_equal(got.view(view), value.view(view))


def test_bf16_readable_by_official_safetensors(tmp_path):
    tensors = _bf16_and_fp8()
    path = tmp_path / "bf16.safetensors"
    save_safetensors(path, {"bf16": tensors["bf16"], "bf16_bits": tensors["bf16_bits"]})
    for framework in ("numpy", "flax"):
        try:
            with safetensors.safe_open(str(path), framework=framework) as f:
                got = {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
        except (AttributeError, TypeError, ValueError, ImportError) as e:
            pytest.skip(f"safetensors cannot read BF16 with framework={framework}: {e}")
        for name in ("bf16", "bf16_bits"):
            assert got[name].dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got[name].view(np.uint16), tensors[name].view(np.uint16))


def test_fp8_readable_by_official_safetensors(tmp_path):
    """The official library reads our FP8 file's index (name, dtype F8_E4M3, shape); its numpy
    backend has no float8 type, so the tensor's bytes are located from the header as the format
    defines it (8-byte little-endian header length, JSON header, data_offsets into the data that
    follows) and compared with the array's."""
    fp8 = _bf16_and_fp8()["fp8"]
    path = tmp_path / "fp8.safetensors"
    save_safetensors(path, {"fp8": fp8})
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert list(f.keys()) == ["fp8"]
        sliced = f.get_slice("fp8")
        assert sliced.get_dtype() == "F8_E4M3"
        assert tuple(sliced.get_shape()) == fp8.shape
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + n])["fp8"]
    assert entry["dtype"] == "F8_E4M3" and tuple(entry["shape"]) == fp8.shape
    begin, end = entry["data_offsets"]
    assert raw[8 + n + begin : 8 + n + end] == fp8.view(np.uint8).tobytes()


# --- corrupt files -----------------------------------------------------------------------------


def _write_raw(path, header: object, data: bytes = b"", *, header_len: int | None = None) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_safetensors(path, {"first": np.zeros(4, np.float32), "last.weight": np.ones((8, 8), np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert str(path) in message
    assert "truncated" in message
    assert "'last.weight'" in message
    assert "'first'" not in message


def test_header_longer_than_file(tmp_path):
    path = tmp_path / "hdr.safetensors"
    _write_raw(
        path, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, header_len=10**6
    )
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as info:
        SafetensorsFile(path)
    assert "1000000" in str(info.value)


def test_absurd_header_length(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        SafetensorsFile(path)


@pytest.mark.parametrize("blob", [b"{not json}", b"\xff\xfe\x00\x01", b"", b"[1, 2]", b'"str"'])
def test_garbage_header(tmp_path, blob):
    path = tmp_path / "garbage.safetensors"
    _write_raw(path, blob)
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as info:
        SafetensorsFile(path)
    assert "header" in str(info.value)


def test_data_offsets_disagree_with_shape(tmp_path):
    path = tmp_path / "size.safetensors"
    header = {
        "ok": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "bad.weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 28]},
    }
    _write_raw(path, header, b"\0" * 32)
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert str(path) in message and "'bad.weight'" in message
    assert "20" in message and "24" in message  # claimed bytes vs needed bytes


def test_unknown_dtype(tmp_path):
    path = tmp_path / "dtype.safetensors"
    _write_raw(path, {"weird": {"dtype": "F4_E2M1", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert str(path) in message and "'weird'" in message and "F4_E2M1" in message


def test_malformed_entry(tmp_path):
    path = tmp_path / "entry.safetensors"
    _write_raw(path, {"t": {"dtype": "F32", "shape": [1]}}, b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"'t'.*malformed"):
        SafetensorsFile(path)


def test_negative_dimension(tmp_path):
    path = tmp_path / "neg.safetensors"
    _write_raw(path, {"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})
    with pytest.raises(CheckpointError, match=r"'t'.*shape"):
        SafetensorsFile(path)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [2], "data_offsets": [0]},
        {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]},
        {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]},
        {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]},
        {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},
    ],
    ids=["one_offset", "string_offset", "int_shape", "list_dtype", "bool_dim"],
)
def test_malformed_header_values_are_checkpoint_errors(tmp_path, entry):
    path = tmp_path / "m.safetensors"
    _write_raw(path, {"t.weight": entry}, b"\0" * 8)
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value) and "'t.weight'" in str(info.value)


@pytest.mark.parametrize("size", [0, 1, 7])
def test_file_shorter_than_eight_bytes(tmp_path, size):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01" * size)
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as info:
        SafetensorsFile(path)
    assert "truncated" in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "absent.safetensors"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        SafetensorsFile(path)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        SafetensorsFile(tmp_path)


# --- atomic writes -----------------------------------------------------------------------------


def test_save_leaves_no_temp_file(tmp_path):
    path = tmp_path / "out.safetensors"
    save_safetensors(path, {"a": np.ones(3, np.float32)})
    save_safetensors(path, {"b": np.zeros(2, np.int32)})  # overwrite in place
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors"]
    assert SafetensorsFile(path).keys() == ["b"]


@pytest.mark.parametrize(
    "bad",
    [np.ones(3, np.complex64), np.array(["a", "b"]), np.array([object()])],
    ids=["complex64", "unicode", "object"],
)
def test_save_failure_leaves_nothing(tmp_path, bad):
    path = tmp_path / "out.safetensors"
    tensors = {"fine": np.ones(4, np.float32), "bad.weight": bad, "after": np.ones(2, np.float32)}
    with pytest.raises(CheckpointError, match=r"'bad\.weight'"):
        save_safetensors(path, tensors)
    assert os.listdir(tmp_path) == []


def test_big_endian_input_is_refused_by_name(tmp_path):
    """safetensors is little-endian: a big-endian array is refused (never written byte-garbled),
    naming the tensor and its dtype, and nothing is left behind."""
    value = np.array([1.5, -2.25, 1e30], dtype=">f4")
    path = tmp_path / "be.safetensors"
    with pytest.raises(CheckpointError, match=r"'be'.*>f4"):
        save_safetensors(path, {"be": value})
    assert os.listdir(tmp_path) == []


def test_save_failure_keeps_previous_file(tmp_path):
    path = tmp_path / "out.safetensors"
    save_safetensors(path, {"old": np.arange(3, dtype=np.int64)})
    before = path.read_bytes()
    with pytest.raises(CheckpointError):
        save_safetensors(path, {"new": np.ones(3, np.complex64)})
    assert path.read_bytes() == before
    assert _no_temp_files(tmp_path)


def test_failure_after_writing_removes_temp_and_keeps_destination_absent(tmp_path, monkeypatch):
    path = tmp_path / "out.safetensors"
    seen = []

    def failing_replace(src, dst):
        seen.append((os.fspath(src), os.path.getsize(src)))
        raise OSError("disk on fire")

    monkeypatch.setattr(safetensors_io.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk on fire"):
        save_safetensors(path, {"a": np.ones((16, 16), np.float32)})
    # The data really went to a temporary sibling first, then it was cleaned up.
    assert len(seen) == 1 and ".tmp-" in seen[0][0] and seen[0][1] > 16 * 16 * 4
    assert os.listdir(tmp_path) == []


# --- CheckpointReader ----------------------------------------------------------------------------


def test_reader_single_file(tmp_path):
    tensors = _sample_tensors()
    save_safetensors(tmp_path / "model.safetensors", tensors)
    reader = CheckpointReader(tmp_path)
    assert sorted(reader.keys()) == sorted(tensors)
    for name, value in tensors.items():
        assert name in reader
        assert reader.shape(name) == value.shape and reader.dtype(name) == value.dtype
        _assert_same(reader.get(name), value)
    assert dict((k, v.shape) for k, v in reader.items()) == {k: v.shape for k, v in tensors.items()}
    with pytest.raises(CheckpointError, match="'missing'"):
        reader.get("missing")


def test_reader_several_files_without_index(tmp_path):
    a = {"x.a": np.arange(3, dtype=np.float32), "x.b": np.ones((2, 2), np.float16)}
    b = {"y.c": np.arange(4, dtype=np.int64)}
    save_safetensors(tmp_path / "part-b.safetensors", b)
    save_safetensors(tmp_path / "part-a.safetensors", a)
    (tmp_path / "README.md").write_text("not a tensor file")
    reader = CheckpointReader(tmp_path)
    assert sorted(reader.keys()) == ["x.a", "x.b", "y.c"]
    for name, value in {**a, **b}.items():
        _assert_same(reader.get(name), value)


def test_reader_duplicate_key_across_files(tmp_path):
    save_safetensors(tmp_path / "one.safetensors", {"dup.weight": np.ones(2, np.float32)})
    save_safetensors(tmp_path / "two.safetensors", {"dup.weight": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(tmp_path)
    message = str(info.value)
    assert "'dup.weight'" in message and "one.safetensors" in message and "two.safetensors" in message


def _write_sharded(directory, shards: dict[str, dict[str, np.ndarray]], weight_map=None) -> None:
    for fname, tensors in shards.items():
        save_safetensors(directory / fname, tensors)
    if weight_map is None:
        weight_map = {k: fname for fname, tensors in shards.items() for k in tensors}
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_reader_index_sharded(tmp_path):
    s1 = {"a": np.arange(5, dtype=np.float32), "b": np.eye(3, dtype=np.float32)}
    s2 = {"c": np.arange(6, dtype=np.int32).reshape(2, 3)}
    _write_sharded(tmp_path, {"model-00001-of-00002.safetensors": s1, "model-00002-of-00002.safetensors": s2})
    # A stray safetensors file not named by the index is not read.
    save_safetensors(tmp_path / "stray.safetensors", {"a": np.zeros(1, np.float32)})
    reader = CheckpointReader(tmp_path)
    assert sorted(reader.keys()) == ["a", "b", "c"]
    for name, value in {**s1, **s2}.items():
        _assert_same(reader.get(name), value)


def test_reader_index_may_list_a_subset_of_a_file(tmp_path):
    # Real hub indices never list tensors a file lacks, but a file may hold extras nobody asks for.
    _write_sharded(
        tmp_path,
        {"m.safetensors": {"a": np.ones(2, np.float32), "extra": np.ones(1, np.float32)}},
        weight_map={"a": "m.safetensors"},
    )
    assert CheckpointReader(tmp_path).keys() == ["a"]


@pytest.mark.parametrize("target", ["../x.safetensors", "sub/../../x.safetensors"])
def test_reader_index_path_escape_refused(tmp_path, target):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_safetensors(tmp_path / "x.safetensors", {"evil.weight": np.ones(1, np.float32)})
    _write_sharded(ckpt, {}, weight_map={"evil.weight": target})
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(ckpt)
    message = str(info.value)
    assert "'evil.weight'" in message and target in message and "outside" in message


def test_reader_index_absolute_path_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    outside = tmp_path / "x.safetensors"
    save_safetensors(outside, {"evil.weight": np.ones(1, np.float32)})
    _write_sharded(ckpt, {}, weight_map={"evil.weight": str(outside)})
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(ckpt)
    message = str(info.value)
    assert "'evil.weight'" in message and str(outside) in message and "outside" in message


def test_reader_index_symlink_escape_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_safetensors(tmp_path / "x.safetensors", {"evil.weight": np.ones(1, np.float32)})
    os.symlink(tmp_path / "x.safetensors", ckpt / "link.safetensors")
    _write_sharded(ckpt, {}, weight_map={"evil.weight": "link.safetensors"})
    with pytest.raises(CheckpointError, match="outside"):
        CheckpointReader(ckpt)


def test_reader_index_names_tensor_its_file_lacks(tmp_path):
    _write_sharded(
        tmp_path,
        {"m.safetensors": {"a": np.ones(2, np.float32)}},
        weight_map={"a": "m.safetensors", "ghost.weight": "m.safetensors"},
    )
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(tmp_path)
    message = str(info.value)
    assert "'ghost.weight'" in message and "m.safetensors" in message and INDEX_NAME in message


def test_reader_index_names_missing_file(tmp_path):
    _write_sharded(tmp_path, {}, weight_map={"a": "model-00009-of-00009.safetensors"})
    with pytest.raises(FileNotFoundError, match="model-00009-of-00009.safetensors"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize(
    "text",
    ["{broken", '{"metadata": {}}', '{"weight_map": ["a"]}', "[]", '{"weight_map": null}'],
    ids=["bad_json", "no_weight_map", "weight_map_list", "not_object", "weight_map_null"],
)
def test_reader_bad_index(tmp_path, text):
    save_safetensors(tmp_path / "m.safetensors", {"a": np.ones(1, np.float32)})
    (tmp_path / INDEX_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(INDEX_NAME)):
        CheckpointReader(tmp_path)


def test_reader_index_file_name_not_a_string(tmp_path):
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a.weight": 3}}))
    with pytest.raises(CheckpointError, match="'a.weight'"):
        CheckpointReader(tmp_path)


def test_reader_directory_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))) as info:
        CheckpointReader(tmp_path)
    assert isinstance(info.value, CheckpointNotFoundError)


def test_reader_missing_directory(tmp_path):
    path = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        CheckpointReader(path)


def test_reader_corrupt_shard_names_the_shard(tmp_path):
    save_safetensors(tmp_path / "a.safetensors", {"a": np.ones(4, np.float32)})
    save_safetensors(tmp_path / "b.safetensors", {"b.weight": np.ones(64, np.float32)})
    data = (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match=r"b\.safetensors.*'b\.weight'"):
        CheckpointReader(tmp_path)


def test_overlapping_or_gapped_offsets_are_refused(tmp_path):
    """The data block must be tiled by the tensors, as the format requires."""

    def write(entries: dict, data: bytes) -> str:
        header = json.dumps(entries).encode()
        header += b" " * (-len(header) % 8)
        path = tmp_path / f"f{len(list(tmp_path.iterdir()))}.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + data)
        return str(path)

    overlap = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    with pytest.raises(CheckpointError, match="'b' overlaps"):
        SafetensorsFile(write(overlap, bytes(12)))
    gap = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    with pytest.raises(CheckpointError, match="'a' leaves a gap of 4 bytes"):
        SafetensorsFile(write(gap, bytes(8)))
    trailing = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    with pytest.raises(CheckpointError, match="cover 4 bytes of a 12-byte"):
        SafetensorsFile(write(trailing, bytes(12)))
