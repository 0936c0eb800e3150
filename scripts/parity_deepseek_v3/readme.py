"""README.md beside the fixtures, read back from the fixture directories on disk."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from .hf import HIDDEN_STATES_DOC, MTP_DOC
from .specs import GREEDY_GAP, GREEDY_NEW, ROUTING_MARGIN, SPECS, FixtureSpec
from .weights import safetensors_header


def fixture_facts(spec: FixtureSpec, out_root: Path) -> dict[str, Any]:
    """README row facts read back from a fixture directory: parameters (no scales) and checkpoint bytes."""
    files = sorted((out_root / spec.name).glob("*.safetensors"))
    n_params = 0
    for f in files:
        for key, h in safetensors_header(f).items():
            if key != "__metadata__" and not key.endswith("_scale_inv"):
                n_params += math.prod(h["shape"])
    return {"n_params": n_params, "checkpoint_bytes": sum(f.stat().st_size for f in files)}


def write_readme(out_root: Path) -> None:
    """Short README next to the fixtures, its table read back from the fixture directories on disk."""
    lines = [
        "# transformers parity fixtures (DeepSeek-V3)",
        "",
        "Tiny random DeepSeek-V3 checkpoints in the exact Hugging Face hub layout (hub-style `config.json`",
        "with `rope_scaling`; float32 safetensors, except `sharded_mtp_bf16` (BF16) and `fp8_mtp` (DeepSeek",
        "block FP8); one file, or shards plus `model.safetensors.index.json`) plus `reference.npz` = outputs",
        "of `transformers.DeepseekV3ForCausalLM` (float32, eager attention, 1 CPU thread) for a",
        "teacher-forced forward over `input_ids` [2, T]; the BF16 / FP8 fixtures are run as their exact",
        "float32 upcast / dequantisation. Do not edit; regenerate with:",
        "",
        "    pip install -e .[parity]   # torch (CPU) + transformers>=5",
        "    python scripts/make_parity_fixtures.py --out tests/fixtures/parity [--only NAME ...]",
        "",
        f"Generated with transformers {transformers.__version__}, torch {torch.__version__}, "
        f"numpy {np.__version__}. The script is deterministic (byte-identical output).",
        "",
        "| fixture | what it exercises | T | params | checkpoint bytes |",
        "|---|---|---|---|---|",
    ]
    for spec in SPECS:
        f = fixture_facts(spec, out_root)
        row = [f"`{spec.name}`", spec.description, spec.seq_len, f["n_params"], f["checkpoint_bytes"]]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    lines += [
        "",
        "`reference.npz`: `input_ids` int32 [B,T]; `logits` float32 [B,T,V]; `hidden_states` float32",
        "[L+1,B,T,H]; `hidden_states_doc` (str); `last_hidden_post_norm` float32 [B,T,H]; `layer_outputs`",
        "float32 [L,B,T,H] (raw residual-stream output of each decoder layer); `greedy` int32 [B,P+N]:",
        "`generate(input_ids[:, :P], max_new_tokens=N, do_sample=False)` with P = `prompt_length` = T // 2,",
        f"N = `new_tokens` = {GREEDY_NEW}, no EOS (every greedy choice at least {GREEDY_GAP} above the",
        "runner-up, every routing decision along it beyond the margin). Fixtures with an MTP layer",
        "(`num_nextn_predict_layers: 1`) add `mtp_logits` float32 [B,T-1,V], `mtp_hidden` float32",
        "[B,T-1,H] (after `shared_head.norm`), `mtp_block_output` float32 [B,T-1,H] (before it) and",
        "`mtp_doc` (str).",
        "",
        "Conventions pinned by the generator (it aborts if transformers ever behaves differently):",
        "",
        f"- {HIDDEN_STATES_DOC}",
        "- RoPE: `rope_interleave` defaults to true, i.e. the rope dims of q/k are interleaved pairs",
        "  (x0,x1),(x2,x3),... each rotated by one frequency (DeepSeek's original layout); transformers",
        "  returns them de-interleaved ([evens, odds]) for both q and k, which leaves q.k unchanged.",
        "- YaRN: inv_freq uses floor/ceil-truncated correction range (beta_fast/beta_slow over",
        "  original_max_position_embeddings); cos and sin are multiplied by mscale(factor, mscale) /",
        "  mscale(factor, mscale_all_dim) (= 1 for the real V3 values), and the softmax scale",
        "  (qk_nope+qk_rope)^-0.5 is multiplied by mscale(factor, mscale_all_dim)^2, where",
        "  mscale(s, m) = 0.1 m ln(s) + 1. YaRN is applied at every position, not only beyond",
        "  original_max_position_embeddings.",
        "- q_a_layernorm and kv_a_layernorm use eps 1e-6 regardless of `rms_norm_eps`.",
        f"- Every MoE routing decision (group and expert choice) has a margin >= {ROUTING_MARGIN} in",
        "  sigmoid-score units, so a float32 implementation should pick exactly the same experts (the",
        "  MTP layer's router included).",
        "- Every reference is also recomputed by an independent float64 numpy forward of the DeepSeek",
        "  equations (relative error < 1e-4 required, ~1e-6 observed).",
        f"- MTP: {MTP_DOC}",
        "- MTP keys: `model.layers.{N}.` holds a full MoE decoder layer plus `enorm`, `hnorm`, `eh_proj`",
        "  [H, 2H], `shared_head.norm`, `shared_head.head` (an exact copy of `lm_head.weight`) and",
        "  `embed_tokens` (an exact copy of `model.embed_tokens.weight`). `DeepseekV3ForCausalLM` leaves",
        "  them all unloaded (reported as unexpected); transformers' `MtpModel` maps `shared_head.norm` to",
        "  `post_norm` and uses the main model's embedding and lm_head instead of the copies.",
    ]
    for spec in SPECS:
        lines += [f"- `{spec.name}`: {note}" for note in spec.notes]
    (out_root / "README.md").write_text("\n".join(lines) + "\n")
