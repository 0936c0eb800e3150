"""Loading straight into a mesh: experts split over the expert axis, results equal to one device.

Multi-device CPU needs XLA_FLAGS before JAX starts, so the mesh checks run in a child process.
"""

from __future__ import annotations

import textwrap

import pytest

import mtp_jax
from mtp_jax.sharding import check_mesh, make_mesh
from tests.conftest import EMBEDDED_MODEL

CHILD = textwrap.dedent(
    """
    import os, sys, tempfile
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    import mtp_jax
    from mtp_jax.checkpoint.convert import convert

    src = sys.argv[1]
    assert len(jax.devices()) == 8
    ids = [[0, 5, 6, 7, 100, 200, 300, 50, 9, 10, 11]]
    ref = mtp_jax.load(src, "float32")
    want = ref.logits(ids)
    want_tokens = ref.generate(ids, max_new_tokens=6, ignore_eos=True).tokens
    tmp = tempfile.TemporaryDirectory()  # removed when the child exits
    dst = os.path.join(tmp.name, "converted")
    convert(src, dst, weights="fp32", progress=False)
    for mesh_shape in [(1, 8), (2, 4)]:
        mesh = mtp_jax.make_mesh(data=mesh_shape[0], expert=mesh_shape[1])
        for path in (src, dst):
            model = mtp_jax.load(path, "float32", mesh=mesh)
            for stack in ("moe", "mtp"):
                gate = model.params[stack]["mlp" if stack == "moe" else "layer"]
                gate = gate["gate"] if stack == "moe" else gate["mlp"]["gate"]
                n_exp = gate.shape[1]
                shards = {tuple(s.data.shape) for s in gate.addressable_shards}
                assert shards == {(gate.shape[0], n_exp // mesh_shape[1]) + gate.shape[2:]}, shards
            embed_shards = {tuple(s.data.shape) for s in model.params["embed"].addressable_shards}
            assert embed_shards == {model.params["embed"].shape}  # replicated
            np.testing.assert_allclose(model.logits(ids), want, rtol=1e-5, atol=1e-5)
            if path == dst:  # generation from the hub checkpoint on these meshes: tests/test_ep.py
                got = model.generate(ids, max_new_tokens=6, ignore_eos=True).tokens
                assert got == want_tokens
    print("SHARDED-OK")
    """
)


@pytest.mark.slow
@pytest.mark.child(CHILD, EMBEDDED_MODEL)
def test_load_into_mesh_matches_single_device(child_output):
    assert "SHARDED-OK" in child_output


def test_mesh_errors():
    with pytest.raises(ValueError, match="needs 2 devices"):
        make_mesh(data=2)
    with pytest.raises(ValueError, match="tensor=2 needs 2 devices"):
        make_mesh(tensor=2)
    with pytest.raises(ValueError, match="'expert' must be a positive integer"):
        make_mesh(expert=0)
    mesh = make_mesh()
    check_mesh(mesh, 8)
    model = mtp_jax.load(EMBEDDED_MODEL, "float32", mesh=mesh)
    assert model.logits([[1, 2, 3]]).shape == (1, 3, model.config.vocab_size)
