"""Generate tiny random DeepSeek-V3 checkpoints plus transformers reference outputs (parity fixtures).

Each fixture directory ``<out>/<name>/`` holds a checkpoint in the exact Hugging Face hub layout
(``config.json`` written with the hub's field names, i.e. ``rope_scaling`` rather than transformers-5's
``rope_parameters``; safetensors, one file or shards plus ``model.safetensors.index.json``) and a
``reference.npz`` produced by ``transformers.DeepseekV3ForCausalLM`` (float32,
``attn_implementation="eager"``, single CPU thread) on a teacher-forced forward pass over ``input_ids``.

Storage (``FixtureSpec.storage``): float32; BF16 (every tensor except the float32
``e_score_correction_bias``); or DeepSeek-V3 block FP8 exactly as on the hub (``quantization_config``
``fp8``/``e4m3``/``dynamic``/[128, 128]; every ``self_attn.*_proj`` and ``mlp.*_proj`` weight F8_E4M3 with a
float32 ``<name>_scale_inv`` [ceil(out/128), ceil(in/128)], W = float32(fp8) * scale_inv[r//128, c//128];
the rest BF16 as above).  transformers always runs the exact float32 values: the BF16 checkpoint is loaded
with ``dtype=float32``, the FP8 one is dequantised here (numpy, checked against a torch read-back of the
written files) into a temporary float32 hub copy.  Fixtures with ``num_nextn_predict_layers: 1`` carry the
MTP layer ``model.layers.{N}.`` (N = num_hidden_layers) and MTP references computed with transformers'
generic ``MtpModel`` (see ``MTP_DOC``).

``reference.npz`` arrays:

* ``input_ids``             int32   [B, T]
* ``logits``                float32 [B, T, V]  full logits of the forward pass
* ``hidden_states``         float32 [L+1, B, T, H]  ``output_hidden_states=True`` tuple, stacked (see below)
* ``hidden_states_doc``     str     [1]  the convention below, in words
* ``last_hidden_post_norm`` float32 [B, T, H]  ``model.model(input_ids).last_hidden_state``
* ``layer_outputs``         float32 [L, B, T, H]  raw output (residual stream, before any final norm) of every
  decoder layer, captured with forward hooks
* ``greedy``                int32   [B, P + N]  ``generate(input_ids[:, :P], max_new_tokens=N,
  do_sample=False)`` (P = ``prompt_length`` = T // 2, N = ``new_tokens``; no EOS), with every routing
  decision and every greedy choice along the generated text (checked teacher-forced) beyond its margin
* MTP fixtures only: ``mtp_logits`` float32 [B, T-1, V], ``mtp_hidden`` float32 [B, T-1, H] (after
  ``shared_head.norm``), ``mtp_block_output`` float32 [B, T-1, H] (before it), ``mtp_doc`` str [1]: row i is
  the MTP layer on (h_i = ``last_hidden_post_norm[:, i]``, token ``input_ids[:, i+1]``), predicting token i+2

Hidden-states convention of transformers 5 for DeepseekV3 (verified by this script with forward hooks on every
run; it aborts if it ever changes): the tuple has ``num_hidden_layers + 1`` entries;
``hidden_states[0]`` is the token embedding (input of layer 0); ``hidden_states[i]`` for ``1 <= i < L`` is the
output of decoder layer ``i - 1`` (= input of layer ``i``); ``hidden_states[L]`` is NOT the raw output of the
last decoder layer but that output after the final ``model.norm`` RMSNorm, i.e. identical to
``last_hidden_post_norm`` (``capture_outputs(tie_last_hidden_states=True)`` overwrites the last entry).  The
pre-norm output of the last layer is only available as ``layer_outputs[L - 1]``.

Weights are drawn with ``numpy.random.default_rng(seed)``; the script is deterministic (fixed seeds, one torch
thread, zip entries with a fixed timestamp), so re-running it rewrites byte-identical files.  Every tensor of
the loaded model is compared exactly with the numpy weights (transformers fuses the per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` keys into ``mlp.experts.gate_up_proj`` [E, 2*I, H] and
``mlp.experts.down_proj`` [E, H, I] on load), the rotary/yarn setup is checked against an independent
recomputation, and inputs are re-drawn until every MoE routing decision (the MTP layer's included) has a safe
margin, so that a correct float32 implementation cannot flip an expert or group choice through rounding.
Every reference is also recomputed by an independent float64 numpy forward of the DeepSeek equations
(``np_reference``) and must agree to 1e-4 relative.  README.md is rewritten on every run from the fixture
directories on disk (once all of them exist), so ``--only`` leaves the other fixtures untouched.

Usage::

    python scripts/make_parity_fixtures.py [--out tests/fixtures/parity] [--only NAME ...]

Needs ``torch`` and ``transformers>=5`` (``pip install -e .[parity]``).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM
except ImportError as exc:  # pragma: no cover - exercised only without the optional deps
    sys.stderr.write(
        "make_parity_fixtures.py needs torch, transformers>=5 and safetensors to generate the reference "
        f"outputs ({exc}).\nInstall them with `pip install -e .[parity]` (torch CPU is enough).\n"
    )
    raise SystemExit(2) from exc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_deepseek_v3.hf import (  # noqa: E402
    HIDDEN_STATES_DOC,
    MTP_DOC,
    check_config,
    check_hub_config,
    check_loaded,
    load_mtp,
    run_greedy,
    run_mtp_reference,
    run_reference,
)
from parity_deepseek_v3.numpy_reference import max_rel_err, np_reference, routing_margin  # noqa: E402
from parity_deepseek_v3.readme import write_readme  # noqa: E402
from parity_deepseek_v3.specs import (  # noqa: E402
    BATCH,
    DEFAULT_OUT,
    GREEDY_NEW,
    MAX_INPUT_TRIES,
    ROUTING_MARGIN,
    SPECS,
    FixtureSpec,
)
from parity_deepseek_v3.weights import (  # noqa: E402
    check_stored,
    encode_weights,
    float32_config,
    make_weights,
    write_checkpoint,
)


def save_npz_deterministic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez, but with fixed zip timestamps so the bytes only depend on the arrays."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def load_reference(spec: FixtureSpec, tmp: Path, exact: dict[str, np.ndarray]) -> tuple[Any, Any, dict]:
    """transformers' model of the written fixture (an FP8 one as its float32 dequantisation, a
    hub-layout copy), checked against the numpy weights and the rotary setup: (model, its MTP layer
    or None, the rotary facts)."""
    cfg = spec.config
    with tempfile.TemporaryDirectory(prefix=f"{spec.name}-float32-") as f32_dir:
        model_dir = tmp
        if spec.storage == "fp8":
            model_dir = Path(f32_dir)
            write_checkpoint(model_dir, float32_config(cfg), exact, 1)
        model, info = DeepseekV3ForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        model.eval()
        check_loaded(model, info, cfg, exact)
        rope_facts = check_config(model, cfg)
        mtp = load_mtp(model, cfg, exact) if cfg["num_nextn_predict_layers"] > 0 else None
    return model, mtp, rope_facts


def draw_inputs(spec: FixtureSpec, model: Any, mtp: Any) -> tuple[np.ndarray, dict, dict, Any, list, int]:
    """Inputs drawn until every routing decision has its margin and every greedy pick is clear:
    (input_ids, the reference, the MTP reference, greedy tokens, the margins, the draws taken)."""
    cfg = spec.config
    biases = [
        layer.mlp.gate.e_score_correction_bias.detach().numpy()
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    if mtp is not None:
        biases.append(mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias.detach().numpy())
    rng = np.random.default_rng(spec.input_seed)
    mtp_ref: dict[str, Any] = {}
    for attempt in range(1, MAX_INPUT_TRIES + 1):
        input_ids = rng.integers(0, cfg["vocab_size"], size=(BATCH, spec.seq_len), dtype=np.int64)
        ref = run_reference(model, input_ids)
        router = ref["router_logits"]
        if mtp is not None:
            mtp_ref = run_mtp_reference(model, mtp, input_ids, ref["last_hidden_post_norm"])
            router = router + mtp_ref["router_logits"]
        margins = [routing_margin(r, b, cfg) for r, b in zip(router, biases, strict=True)]
        if min(margins, default=math.inf) < ROUTING_MARGIN:
            continue
        greedy = run_greedy(model, input_ids, biases, cfg)
        if greedy is not None:
            return input_ids, ref, mtp_ref, greedy, margins, attempt
    raise RuntimeError(
        f"{spec.name}: no input draw with routing margins >= {ROUTING_MARGIN} and clear greedy picks"
    )


def check_references(
    spec: FixtureSpec, exact: dict, input_ids: np.ndarray, ref: dict, mtp_ref: dict
) -> dict[str, float]:
    """The references are not degenerate and agree with the float64 numpy forward: its relative
    errors by output."""
    cfg = spec.config
    checked = {"logits": ref["logits"], "last_hidden_post_norm": ref["last_hidden_post_norm"]}
    checked.update({k: v for k, v in mtp_ref.items() if k.startswith("mtp_")})
    for name, logits in checked.items():
        if not name.endswith("logits"):
            continue
        top1 = logits.argmax(-1)
        n_top1 = len(np.unique(top1))
        if float(logits.std(-1).min()) < 0.3 or n_top1 < 5:
            std = float(logits.std(-1).min())
            raise RuntimeError(f"{spec.name}: degenerate {name} (min std {std}, {n_top1} distinct top-1)")
    has_mtp = cfg["num_nextn_predict_layers"] > 0
    independent = np_reference(exact, cfg, input_ids, ref["last_hidden_post_norm"] if has_mtp else None)
    np_err = {k: max_rel_err(v, independent[k]) for k, v in checked.items()}
    if max(np_err.values()) > 1e-4:
        raise RuntimeError(f"{spec.name}: transformers and the float64 numpy forward disagree: {np_err}")
    return np_err


def reference_arrays(input_ids: np.ndarray, ref: dict, mtp_ref: dict, greedy: np.ndarray) -> dict:
    """reference.npz's arrays."""
    arrays = {
        "input_ids": input_ids.astype(np.int32),
        "logits": ref["logits"],
        "hidden_states": ref["hidden_states"],
        "hidden_states_doc": np.array([HIDDEN_STATES_DOC]),
        "last_hidden_post_norm": ref["last_hidden_post_norm"],
        "layer_outputs": ref["layer_outputs"],
        "greedy": greedy.astype(np.int32),
        "prompt_length": np.int32(greedy.shape[1] - GREEDY_NEW),
        "new_tokens": np.int32(GREEDY_NEW),
    }
    if mtp_ref:
        arrays.update(
            {
                "mtp_logits": mtp_ref["mtp_logits"],
                "mtp_hidden": mtp_ref["mtp_hidden"],
                "mtp_block_output": mtp_ref["mtp_block_output"],
                "mtp_doc": np.array([MTP_DOC]),
            }
        )
    return arrays


def build_fixture(spec: FixtureSpec, out_root: Path) -> dict[str, Any]:
    """Write one fixture directory (via a temp dir + rename) and return a summary."""
    cfg = spec.config
    weights = make_weights(cfg, spec.weight_seed, spec.kv_latent_gain)
    stored, exact = encode_weights(spec, weights)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=out_root))
    try:
        write_checkpoint(tmp, cfg, stored, spec.shards)
        storage_facts = check_stored(tmp, spec, stored, exact)
        check_hub_config(tmp, cfg)
        model, mtp, rope_facts = load_reference(spec, tmp, exact)
        input_ids, ref, mtp_ref, greedy, margins, attempt = draw_inputs(spec, model, mtp)
        np_err = check_references(spec, exact, input_ids, ref, mtp_ref)
        save_npz_deterministic(tmp / "reference.npz", reference_arrays(input_ids, ref, mtp_ref, greedy))
        final = out_root / spec.name
        if final.exists():
            shutil.rmtree(final)
        for f in tmp.iterdir():  # safetensors writes 0600 files; make them ordinary repo files
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logits = ref["logits"]
    return {
        "name": spec.name,
        "description": spec.description,
        "seq_len": spec.seq_len,
        "input_draws": attempt,
        "min_routing_margin": min(margins, default=math.inf),
        "n_params": int(sum(a.size for a in weights.values())),
        "checkpoint_bytes": sum(f.stat().st_size for f in final.glob("*.safetensors")),
        "dir_bytes": sum(f.stat().st_size for f in final.iterdir()),
        "logit_std": float(logits.std()),
        "distinct_top1": len(np.unique(logits.argmax(-1))),
        "rope": rope_facts,
        "numpy_rel_err": np_err,
        "storage": storage_facts,
        "mtp": {k: v for k, v in mtp_ref.items() if k.endswith("_err")},
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output root (default {DEFAULT_OUT})")
    ap.add_argument("--only", nargs="*", default=None, help="build only these fixtures")
    args = ap.parse_args(argv)
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        sys.stderr.write(f"transformers>=5 is required, found {transformers.__version__}\n")
        return 2

    transformers.logging.set_verbosity_error()  # the MTP layer's keys are reported as unexpected on purpose
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = [s for s in SPECS if args.only is None or s.name in args.only]
    if args.only:
        missing = set(args.only) - {s.name for s in specs}
        if missing:
            ap.error(f"unknown fixtures {sorted(missing)}; known: {[s.name for s in SPECS]}")
    summaries = []
    for spec in specs:
        summary = build_fixture(spec, args.out)
        summaries.append(summary)
        r = summary["rope"]
        print(
            f"{summary['name']:>20}: {summary['n_params']} params, ckpt {summary['checkpoint_bytes']} B, "
            f"dir {summary['dir_bytes']} B, T={summary['seq_len']}, draws={summary['input_draws']}, "
            f"routing margin {summary['min_routing_margin']:.4f}, logit std {summary['logit_std']:.3f}, "
            f"{summary['distinct_top1']} distinct top-1"
        )
        print(
            f"{'':>20}  rope_type={r['rope_type']} inv_freq={[round(x, 6) for x in r['inv_freq']]} "
            f"cos/sin factor={r['cos_sin_attention_factor']:.6f} softmax scale={r['softmax_scale']:.6f} "
            f"(plain {r['softmax_scale_without_mscale']:.6f})"
        )
        st, errs = summary["storage"], {**summary["numpy_rel_err"], **summary["mtp"]}
        print(
            f"{'':>20}  dtypes {st['dtypes']}, {st['fp8_weights']} fp8 weights (min block-scale ratio "
            f"{st['fp8_min_scale_ratio']:.2f}); rel. err vs float64 numpy / checks: "
            + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        )
    absent = [spec.name for spec in SPECS if not (args.out / spec.name).is_dir()]
    if absent:
        print(f"README.md not rewritten: fixtures {absent} are not in {args.out}")
    else:
        write_readme(args.out)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
