"""Per-host loading: a process reads only the routed experts its devices hold, and the global arrays
built from those reads equal a plain load bit for bit. (The multi-process run itself is in
tests/test_launch.py.)"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.sharding import local_experts, make_mesh
from mtp_jax.targets.deepseek_v3.checkpoint import ExpertRows, assemble, load_params, param_groups
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from tests.checkpoint.test_fp8 import fp8_pair  # noqa: F401  (module-scoped fixture)

EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _spied(path: str) -> tuple[CheckpointReader, list[str]]:
    reader, read = CheckpointReader(path), []
    real = reader.get

    def get(key: str) -> np.ndarray:
        read.append(key)
        return real(key)

    reader.get = get
    return reader, read


def _groups(path: str, weights: str, experts):
    reader, read = _spied(path)
    cfg = DeepseekV3Config.from_json_file(f"{path}/config.json")
    groups = [
        g for g, _ in param_groups(reader, cfg, np.float32, weights=weights, strict=True, experts=experts)
    ]
    return cfg, groups, read


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(f"u{x.dtype.itemsize}")


@pytest.mark.parametrize("weights", ["dense", "fp8"])
def test_a_subset_of_experts_reads_only_their_tensors(fp8_pair, weights):  # noqa: F811
    path = fp8_pair[0]
    cfg, full, read_all = _groups(path, weights, None)
    _, part, read_part = _groups(path, weights, [5, 2])
    experts_read = {int(m.group(2)) for k in read_part if (m := EXPERT_KEY.match(k))}
    assert experts_read == {2, 5}
    assert any(k.endswith("weight_scale_inv") and EXPERT_KEY.match(k) for k in read_part)
    others = [k for k in read_all if not EXPERT_KEY.match(k) or int(EXPERT_KEY.match(k).group(2)) in (2, 5)]
    assert sorted(read_part) == sorted(others)
    n_rows = 0
    for (name, index, a), (_, _, b) in zip(full, part, strict=True):
        for (path_, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
            if not isinstance(y, ExpertRows):
                np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=f"{name} {index} {path_}")
                continue
            assert y.shape == x.shape and y.dtype == x.dtype and sorted(y.rows) == [2, 5]
            for e in (2, 5):
                np.testing.assert_array_equal(_bits(x[e]), _bits(y.rows[e]))
            np.testing.assert_array_equal(_bits(x[2:3]), _bits(y[(slice(2, 3),)]))
            n_rows += 1
            rows = y
    # gate, up, down of every MoE layer and of the MTP layer (each FP8 weight is two leaves)
    assert n_rows == 3 * (cfg.num_moe_layers + 1) * (2 if weights == "fp8" else 1)
    with pytest.raises(ValueError, match=r"experts \[3\] were not read by this process"):
        rows[(slice(2, 4),)]


@pytest.mark.parametrize("weights", ["dense", "fp8"])
def test_global_arrays_from_expert_rows_equal_a_plain_load(fp8_pair, weights):  # noqa: F811
    path = fp8_pair[0]
    cfg = DeepseekV3Config.from_json_file(f"{path}/config.json")
    want = load_params(CheckpointReader(path), cfg, np.float32, weights=weights)
    # every expert named explicitly: the ExpertRows path, on a one-device mesh
    _, groups, _ = _groups(path, weights, list(range(cfg.n_routed_experts)))
    got = assemble(iter(groups), cfg, np.float32, mesh=make_mesh())
    la, ta = jax.tree.flatten(want)
    lb, tb = jax.tree.flatten(got)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_one_process_holds_every_expert():
    assert local_experts(make_mesh(), 8) is None
