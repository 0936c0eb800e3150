"""A trained full-vocabulary DSpark draft restricted to a draft vocabulary, without retraining.

    python scripts/restrict_dspark_vocab.py --draft checkpoints/smollm2-135m-instruct-dspark \\
        --tokens training/replies-smollm2-135m-instruct-train-160.jsonl --vocab 8192 --out /tmp/dspark-8192

The draft vocabulary is the ``--vocab`` most frequent tokens of ``--tokens`` (a corpus directory of
``scripts/build_corpus.py``: every conversation's tokens; or a JSON-lines file of the target's
replies, ``{"reply": [ids]}`` per line, as ``scripts/distill_data.py`` writes them), ties to the
lower id, as the training scripts choose theirs. The draft keeps every weight; its Markov head's W2
keeps the rows of those tokens, and ``d2t`` / ``t2d`` and ``draft_vocab_size`` are added (mtp-jax's
extension, docs/formats.md "DSpark drafts"). The restricted draft's distribution at each slot is
the full draft's conditioned on the draft vocabulary (the same logits there, -inf elsewhere): a
valid draft at once, whose step reads the target's head for those columns only. The output
directory is written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax.checkpoint.hub_layout import vocab_map_tensors  # noqa: E402
from mtp_jax.checkpoint.safetensors_io import CheckpointReader, write_hub_checkpoint  # noqa: E402
from mtp_jax.train.frozen import draft_vocabulary  # noqa: E402
from mtp_jax.train.shards import iter_conversations  # noqa: E402

W2 = "markov_head.markov_w2.weight"


def token_stream(path: str) -> np.ndarray:
    """Every token of a corpus directory, or of a replies JSON-lines file's replies."""
    if os.path.isdir(path):
        parts = [c.tokens for c in iter_conversations(path)]
    else:
        with open(path, encoding="utf-8") as f:
            parts = [np.asarray(json.loads(line)["reply"], np.int64) for line in f if line.strip()]
    if not parts:
        raise SystemExit(f"--tokens {path}: no tokens")
    return np.concatenate(parts).astype(np.int64)


def restrict(draft: str, tokens: np.ndarray, size: int) -> tuple[dict, dict[str, np.ndarray], np.ndarray]:
    """(config.json, tensors, the draft vocabulary's ids) of ``draft`` restricted to the ``size``
    most frequent of ``tokens``."""
    with open(os.path.join(draft, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    if raw.get("architectures") != ["Qwen3DSparkModel"]:
        raise SystemExit(f"--draft {draft} is not a DSpark draft (architectures {raw.get('architectures')})")
    vocab = int(raw["vocab_size"])
    if raw.get("draft_vocab_size") not in (None, vocab):
        raise SystemExit(f"--draft {draft} already has a draft vocabulary of {raw['draft_vocab_size']}")
    if not 1 <= size <= vocab:
        raise SystemExit(f"--vocab {size} must be in [1, {vocab}] (the target's vocabulary)")
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise SystemExit(
            f"--tokens holds ids outside the draft's vocabulary of {vocab}: another model's text"
        )
    ids = draft_vocabulary([tokens], vocab, size)
    reader = CheckpointReader(draft)
    tensors = {key: reader.get(key) for key in reader.keys()}
    if W2 in tensors:
        tensors[W2] = np.ascontiguousarray(tensors[W2][ids])
    tensors.update(vocab_map_tensors(ids, vocab))
    return {**raw, "draft_vocab_size": size}, tensors, ids


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--draft", required=True, help="a DSpark draft directory (the whole vocabulary)")
    parser.add_argument("--tokens", required=True, help="a corpus directory or a replies JSON-lines file")
    parser.add_argument("--vocab", type=int, required=True, help="draft vocabulary size")
    parser.add_argument("--out", required=True, help="the restricted draft's directory (must not exist)")
    args = parser.parse_args()
    if os.path.exists(args.out):
        parser.error(f"--out {args.out} already exists; choose a new directory")
    tokens = token_stream(args.tokens)
    raw, tensors, ids = restrict(args.draft, tokens, args.vocab)
    share = float(np.isin(tokens, ids).mean())
    name = os.path.basename(os.path.normpath(args.draft))
    note = (
        f"# DSpark draft {name}, restricted to {args.vocab:,} tokens\n\n"
        f"Made by `scripts/restrict_dspark_vocab.py` from `{args.draft}`: every weight kept, the Markov\n"
        f"head's W2 rows of the {args.vocab:,} most frequent tokens of `{args.tokens}` ({share:.1%} of\n"
        f"its {len(tokens):,} tokens), `d2t` / `t2d` added. Each slot drafts from the full draft's\n"
        "distribution conditioned on that vocabulary. The original's card has its training.\n"
    )
    readme = os.path.join(
        os.path.dirname(os.path.abspath(args.out)), f".{os.path.basename(args.out)}.README.md"
    )
    with open(readme, "w", encoding="utf-8") as f:
        f.write(note)
    try:
        write_hub_checkpoint(args.out, raw, tensors, extra_files={"README.md": readme})
    finally:
        os.remove(readme)
    print(f"wrote {args.out}: {args.vocab:,} tokens, {share:.1%} of the token stream's", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
