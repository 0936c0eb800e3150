"""Write the LoRA parity fixtures: PEFT adapters over the Llama-family parity checkpoints, plus what
``transformers`` + ``peft`` compute with them.

    pip install -e .[parity] peft   # torch (CPU), transformers>=5, peft
    python scripts/make_lora_parity_fixtures.py --out tests/fixtures/lora [--only NAME ...]

Each fixture directory holds an adapter exactly as ``peft``'s ``save_pretrained`` writes it
(``adapter_config.json`` + ``adapter_model.safetensors``), made by ``peft.get_peft_model`` over one
base checkpoint of ``tests/fixtures/parity_llama`` or ``tests/fixtures/parity`` (DeepSeek-V3; its
path under ``tests/fixtures`` in ``base.txt``) with its LoRA weights
drawn at random (peft starts lora_B at zero, which would prove nothing), and ``reference.npz``:

- ``input_ids`` int32 [B, T]; ``logits`` float32 [B, T, V]: the adapted model, teacher-forced;
- ``base_logits`` float32 [B, T, V]: the same inputs with the adapter disabled;
- ``greedy`` int32 [B, P + N]: the adapted model's ``generate(input_ids[:, :P], max_new_tokens=N,
  do_sample=False)``, with ``prompt_length`` P and ``new_tokens`` N.

float32, eager attention, one CPU thread; deterministic (the same bytes every run, up to the
safetensors header order peft writes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES_DIR = os.path.join(REPO, "tests", "fixtures")
PROMPT, NEW = 6, 8

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

FIXTURES: dict[str, dict] = {
    # attention only, the usual alpha = 2r
    "llama_attn_r8": dict(
        base="parity_llama/llama3_gqa42",
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    ),
    # every projection, rsLoRA scaling, per-module ranks and alphas, two of the three layers
    "llama_all_rslora_patterns": dict(
        base="parity_llama/llama3_gqa42",
        r=4,
        lora_alpha=8,
        target_modules=ALL,
        use_rslora=True,
        rank_pattern={"o_proj": 2, "down_proj": 6},
        alpha_pattern={"down_proj": 3.0},
        layers_to_transform=[0, 2],
    ),
    # target_modules as a regular expression, MLP only, on Qwen2 (biases, tied head)
    "qwen2_mlp_regex_r16": dict(
        base="parity_llama/qwen2_bias_tied",
        r=16,
        lora_alpha=32,
        target_modules=r".*\.mlp\.(gate|up|down)_proj",
    ),
    # Qwen3 (q/k norms after the adapted projections)
    "qwen3_qkv_r2": dict(
        base="parity_llama/qwen3_qk_norm", r=2, lora_alpha=1, target_modules=["q_proj", "k_proj", "v_proj"]
    ),
    # DeepSeek-V3: every MLA projection (kv_b_proj too, absorbed in decode). Not the MLPs here: given
    # gate/up/down_proj, peft 0.21 adapts the fused routed experts' parameters (target_parameters,
    # which mtp-jax refuses) instead of the dense and shared-expert MLPs; tests/test_lora.py checks
    # those against the adapter merged into the weights
    "deepseek_mla_r8": dict(
        base="parity/base",
        r=8,
        lora_alpha=16,
        target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    ),
    # without q_lora (q_proj), rsLoRA, kv_b and o only
    "deepseek_q_kv_b_rslora_r4": dict(
        base="parity/odd_heads",
        r=4,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["q_proj", "kv_b_proj", "o_proj"],
    ),
}


def build(name: str, out: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    spec = dict(FIXTURES[name])
    base = spec.pop("base")
    base_dir = os.path.join(FIXTURES_DIR, base)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **spec)
    peft_model = get_peft_model(model, config)
    rng = np.random.default_rng(sum(map(ord, name)))
    with torch.no_grad():
        for key, param in sorted(peft_model.named_parameters()):
            if "lora_A" in key or "lora_B" in key:
                fan = param.shape[1]
                values = rng.normal(0.0, 1.0 / np.sqrt(fan), param.shape).astype(np.float32)
                param.copy_(torch.from_numpy(values))
    peft_model.eval()
    directory = os.path.join(out, name)
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(tmp, safe_serialization=True)
    config_path = os.path.join(tmp, "adapter_config.json")
    with open(config_path) as f:
        saved = json.load(f)
    saved["base_model_name_or_path"] = f"tests/fixtures/{base}"  # not this machine's path
    if isinstance(saved["target_modules"], list):  # peft writes a set: its order varies between runs
        saved["target_modules"] = sorted(saved["target_modules"])
    with open(config_path, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(tmp, "base.txt"), "w") as f:
        f.write(base + "\n")
    vocab = model.config.vocab_size
    input_ids = rng.integers(3, vocab, (2, 12)).astype(np.int32)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    with torch.no_grad():
        logits = peft_model(ids).logits.numpy()
        with peft_model.disable_adapter():
            base_logits = peft_model(ids).logits.numpy()
        greedy = peft_model.generate(
            input_ids=ids[:, :PROMPT], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW
        ).numpy()
    assert np.abs(logits - base_logits).max() > 1e-2, (
        "the adapter changes nothing: the fixture would prove nothing"
    )
    np.savez_compressed(
        os.path.join(tmp, "reference.npz"),
        input_ids=input_ids,
        logits=logits.astype(np.float32),
        base_logits=base_logits.astype(np.float32),
        greedy=greedy.astype(np.int32),
        prompt_length=np.int32(PROMPT),
        new_tokens=np.int32(NEW),
    )
    for leftover in ("README.md",):  # peft's model card template: not ours to ship
        if os.path.exists(os.path.join(tmp, leftover)):
            os.remove(os.path.join(tmp, leftover))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    print(f"{name}: {directory} (over {base})")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "lora"))
    parser.add_argument("--only", nargs="+", choices=sorted(FIXTURES))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or FIXTURES:
        build(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
