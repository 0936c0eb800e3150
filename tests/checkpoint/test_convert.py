"""mtp-jax convert: hub -> orbax round trips, FP8, interruption and resume, bad input, CLI."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.convert import MANIFEST, convert
from mtp_jax.cli import main as cli_main
from mtp_jax.fp8 import Fp8Weight
from tests.checkpoint.test_fp8 import IDS, fp8_pair  # noqa: F401  (module-scoped fixture)
from tests.conftest import DEEPSEEK_V3_CONFIG, EMBEDDED_MODEL, REPO


def group_count(path: str) -> int:
    """embedding + one group per layer + final norm + head + one per MTP layer."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    return 3 + c["num_hidden_layers"] + c["num_nextn_predict_layers"]


def assert_same_params(a: dict, b: dict) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x.astype(np.float32)), np.asarray(y.astype(np.float32)))


@pytest.mark.parametrize(("weights", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_round_trip_equals_direct_load(tmp_path, weights, dtype):
    dst = tmp_path / "out"
    report = convert(EMBEDDED_MODEL, dst, weights=weights, progress=False)
    assert report.groups == group_count(EMBEDDED_MODEL) and report.groups_resumed == 0
    assert not os.path.exists(f"{dst}.partial")
    for name in ("config.json", "tokenizer.json", "generation_config.json", MANIFEST):
        assert (dst / name).is_file()
    direct, converted = mtp_jax.load(EMBEDDED_MODEL, dtype), mtp_jax.load(dst, dtype)
    assert_same_params(direct.params, converted.params)
    np.testing.assert_array_equal(direct.logits(IDS), converted.logits(IDS))
    assert converted.tokenizer_path is not None and converted.eos_token_ids == direct.eos_token_ids


LLAMA = os.path.join(REPO, "tests", "fixtures", "parity_llama")
SOURCES = {
    "deepseek_fp32": os.path.join(REPO, "tests", "fixtures", "parity", "base"),
    "deepseek_bf16": EMBEDDED_MODEL,
    "llama_fp32": os.path.join(LLAMA, "llama3_gqa42"),
    "llama_bf16_sharded": os.path.join(LLAMA, "sharded_bf16_rope_parameters"),
    "llama_fp16_tied": os.path.join(LLAMA, "mha_fp16"),
}


@pytest.mark.parametrize("source", [*SOURCES, "deepseek_fp8"])
def test_default_conversion_loads_exactly_as_the_source(tmp_path, source, fp8_pair):  # noqa: F811
    """Without --weights every tensor keeps its stored precision (FP8 with its scales), so the
    converted checkpoint gives exactly the parameters and logits of the source, in either dtype."""
    src = fp8_pair[0] if source == "deepseek_fp8" else SOURCES[source]
    dst = tmp_path / "out"
    convert(src, dst, progress=False)
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["weights"] == "auto" and manifest["fp8_kept"] == (source == "deepseek_fp8")
    ids = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]]
    for dtype in ("float32", "bfloat16"):
        direct, converted = mtp_jax.load(src, dtype), mtp_jax.load(dst, dtype)
        assert_same_params(direct.params, converted.params)
        np.testing.assert_array_equal(direct.logits(ids), converted.logits(ids))
    if source == "deepseek_fp8":
        assert_same_params(
            mtp_jax.load(src, "bfloat16", weights="fp8").params,
            mtp_jax.load(dst, "bfloat16", weights="fp8").params,
        )
    jax.clear_caches()


def test_fp8_conversion(tmp_path, fp8_pair):  # noqa: F811
    fp8_dir, _ = fp8_pair
    dst = tmp_path / "fp8"
    convert(fp8_dir, dst, weights="fp8", progress=False)
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["weights"] == "fp8" and manifest["fp8"]
    # --weights fp8 stores FP8 weights as they are and everything else in bf16
    kept_direct = mtp_jax.load(fp8_dir, "bfloat16", weights="fp8")
    kept = mtp_jax.load(dst, "bfloat16", weights="fp8")
    assert isinstance(kept.params["moe"]["mlp"]["gate"], Fp8Weight)
    assert_same_params(kept_direct.params, kept.params)
    dense = mtp_jax.load(dst, "bfloat16")  # dequantised at load
    assert_same_params(dense.params, mtp_jax.load(fp8_dir, "bfloat16").params)
    dense_dst = tmp_path / "dense"
    convert(fp8_dir, dense_dst, weights="fp32", progress=False)
    assert_same_params(mtp_jax.load(fp8_dir, "float32").params, mtp_jax.load(dense_dst, "float32").params)
    with pytest.raises(mtp_jax.CheckpointError, match="converted with its FP8 weights kept"):
        mtp_jax.load(dense_dst, "float32", weights="fp8")


class Interrupt(Exception):
    pass


def test_interrupted_conversion_leaves_no_checkpoint_and_resumes(tmp_path):
    dst = tmp_path / "out"
    seen = []

    def stop_after_three(group: str) -> None:
        seen.append(group)
        if len(seen) == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        convert(EMBEDDED_MODEL, dst, weights="fp32", progress=False, on_group=stop_after_three)
    assert not dst.exists() and (tmp_path / "out.partial").is_dir()
    with pytest.raises(FileNotFoundError):
        mtp_jax.load(dst)
    report = convert(EMBEDDED_MODEL, dst, weights="fp32", progress=False)
    assert report.groups_resumed == 3 and report.groups == group_count(EMBEDDED_MODEL)
    assert not (tmp_path / "out.partial").exists()
    assert_same_params(mtp_jax.load(EMBEDDED_MODEL, "float32").params, mtp_jax.load(dst, "float32").params)


def test_interrupted_conversion_with_other_options_starts_over(tmp_path):
    dst = tmp_path / "out"

    def stop(group: str) -> None:
        raise Interrupt

    with pytest.raises(Interrupt):
        convert(EMBEDDED_MODEL, dst, weights="fp32", progress=False, on_group=stop)
    report = convert(EMBEDDED_MODEL, dst, weights="bf16", progress=False)
    assert report.groups_resumed == 0
    assert mtp_jax.load(dst, "bfloat16").params["embed"].dtype == np.dtype("bfloat16")


def test_convert_refusals(tmp_path, make_checkpoint):
    with pytest.raises(FileNotFoundError, match="not found"):
        convert(tmp_path / "missing", tmp_path / "x", progress=False)
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert(EMBEDDED_MODEL, tmp_path / "exists", progress=False)
    with pytest.raises(mtp_jax.CheckpointError, match="needs an FP8 source"):
        convert(EMBEDDED_MODEL, tmp_path / "y", weights="fp8", progress=False)
    with pytest.raises(ValueError, match="weights must be one of"):
        convert(EMBEDDED_MODEL, tmp_path / "y", weights="int8", progress=False)
    done = tmp_path / "done"
    convert(EMBEDDED_MODEL, done, weights="fp32", progress=False)
    with pytest.raises(mtp_jax.CheckpointError, match="already a converted"):
        convert(done, tmp_path / "again", progress=False)
    assert not (tmp_path / "y").exists() and not (tmp_path / "y.partial").exists()


def test_convert_without_mtp(tmp_path):
    dst = tmp_path / "nomtp"
    convert(EMBEDDED_MODEL, dst, weights="fp32", mtp=False, progress=False)
    assert "mtp" not in mtp_jax.load(dst, "float32").params


def test_cli_convert_and_inspect(tmp_path, capsys):
    dst = tmp_path / "cli"
    assert cli_main(["convert", EMBEDDED_MODEL, str(dst), "--weights", "fp32"]) == 0
    out = capsys.readouterr()
    assert "wrote" in out.out and "MB/s" in out.out and "tensors" in out.err  # progress on stderr
    assert cli_main(["convert", EMBEDDED_MODEL, str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["generate", "--model", str(dst), "--prompt", "def f", "--max-new-tokens", "3"]) == 0
    assert cli_main(["convert", EMBEDDED_MODEL, str(tmp_path / "dry"), "--dry-run"]) == 0
    assert "Parameters" in capsys.readouterr().out and not (tmp_path / "dry").exists()


def test_cli_inspect_real_deepseek_v3(tmp_path, capsys):
    config = DEEPSEEK_V3_CONFIG
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = [
        "inspect",
        "--config",
        str(path),
        "--weights",
        "fp8",
        "--mesh",
        "data=1,expert=8",
        "--kv-tokens",
        "1000000",
        "--device-memory-gb",
        "141",
    ]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "671.03B" in out and "fits" in out
    assert cli_main(["inspect", "--config", str(path), "--mesh", "data=1,expert=7"]) == 2
    assert "expert" in capsys.readouterr().err
    assert cli_main(["inspect", "--config", str(path), "--mesh", "garbage"]) == 2
    assert os.path.isdir(REPO)
