"""Write GGUF fixtures with llama.cpp's own converter, from the Llama-family parity fixtures.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # llama.cpp's source inside
    tar xzf llama_cpp_python-0.3.36.tar.gz
    pip install torch transformers safetensors llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py
    python scripts/make_gguf_fixtures.py --llama-cpp llama_cpp_python-0.3.36/vendor/llama.cpp

For each of ``tests/fixtures/parity_llama/{llama3_gqa42,qwen2_bias_tied}`` (a tiny hub-layout
checkpoint and what transformers computes on it) this runs ``convert_hf_to_gguf.py`` (float32) and
writes ``tests/fixtures/gguf/NAME.gguf``: the tensor names, the q/k row permutation of Llama's
attention (Qwen2 has none), the llama3 ``rope_freqs`` tensor and the metadata are then llama.cpp's,
not ours, and ``tests/checkpoint/test_gguf.py`` checks our reader's logits against transformers'.

The parity checkpoints carry no tokenizer; the converter needs one, so a byte-level BPE of the
checkpoint's vocabulary size is written beside it (printable ASCII, then merges of frequent pairs
of a fixed text), and its pre-tokenizer declared as Llama 3's (``llama-bpe``: the converter
recognises pre-tokenizers by a hash of known vocabularies). Deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = ("llama3_gqa42", "qwen2_bias_tied")
TEXT = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.\n"
    "import os, sys; print(sorted(set(os.listdir('.'))), file=sys.stderr)\n"
)

RUN_CONVERTER = """
import sys
sys.path.insert(0, sys.argv[1])
sys.argv = sys.argv[2:]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def byte_level_tokenizer(vocab_size: int, specials: dict[int, str]) -> dict:
    """tokenizer.json of a byte-level BPE with exactly ``vocab_size`` ids, ``specials`` at theirs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.decoders import ByteLevel as ByteLevelDecoder

    # the byte-level alphabet maps bytes 33-126 to themselves and space/newline elsewhere
    byte_char = {b: chr(b) for b in range(33, 127)} | {32: "\u0120", 10: "\u010a"}
    vocab: dict[str, int] = {"<unk>": 0}
    for i in sorted(specials):
        vocab[specials[i]] = i
    nxt = 0

    def add(token: str) -> None:
        nonlocal nxt
        while nxt in vocab.values():
            nxt += 1
        vocab[token] = nxt

    for b in sorted(byte_char):
        add(byte_char[b])
    words = [[byte_char[b] for b in w.encode()] for w in TEXT.replace("\n", " \n ").split(" ")]
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pairs: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w[:-1], w[1:], strict=True):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        add(best[0] + best[1])
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i : i + 2] = [best[0] + best[1]]
                i += 1
    assert len(vocab) == vocab_size, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = ByteLevelDecoder()
    return json.loads(tok.to_str())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "gguf"))
    args = ap.parse_args()
    converter = os.path.join(args.llama_cpp, "convert_hf_to_gguf.py")
    if not os.path.isfile(converter):
        sys.exit(f"no convert_hf_to_gguf.py in {args.llama_cpp}")
    os.makedirs(args.out, exist_ok=True)
    for name in FIXTURES:
        src = os.path.join(REPO, "tests", "fixtures", "parity_llama", name)
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        with tempfile.TemporaryDirectory() as tmp:
            for f in ("config.json", "model.safetensors"):
                shutil.copy(os.path.join(src, f), tmp)
            # transformers picks the tokenizer class by model type: Qwen2's adds <|endoftext|>
            # unless it is there
            eos_text = "<|endoftext|>" if config["model_type"] == "qwen2" else "</s>"
            specials = {config["bos_token_id"]: "<s>", config["eos_token_id"]: eos_text}
            with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
                json.dump(byte_level_tokenizer(config["vocab_size"], specials), f)
            with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
                json.dump({"bos_token": "<s>", "eos_token": eos_text}, f)
            out = os.path.join(args.out, f"{name}.gguf")
            part = out + ".part"
            cmd = [sys.executable, "-c", RUN_CONVERTER, args.llama_cpp, converter, tmp]
            cmd += ["--outtype", "f32", "--outfile", part, "--model-name", name]
            subprocess.run(cmd, check=True, cwd=args.llama_cpp)
            os.replace(part, out)
            print(f"wrote {out} ({os.path.getsize(out):,} bytes)")


if __name__ == "__main__":
    main()
