"""Generate a real chat model's greedy replies to the self-distillation prompts
(:mod:`mtp_jax.train.distill`) ahead of a draft-training run (resumable; the training scripts make
them too when missing).

    python scripts/distill_data.py --target smollm2-135m-instruct --dir work/
"""

from __future__ import annotations

import argparse
import os
import sys

import mtp_jax
from mtp_jax.train.distill import build_prompts, generate_replies, replies_path


def main() -> int:
    parser = argparse.ArgumentParser(description="Generate a target's replies to the distillation prompts.")
    parser.add_argument("--target", required=True, help="a chat model (directory, .gguf, or packaged name)")
    parser.add_argument(
        "--dir", required=True, help="where the replies are kept (the drafts' parent directory)"
    )
    parser.add_argument("--reply-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-files", type=int, help="use only the first N modules (smoke tests)")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    model = mtp_jax.load(args.target, "float32")
    train, held = build_prompts(args.max_files)
    for split, prompts in (("heldout", held), ("train", train)):
        path = replies_path(args.dir, args.target, split, args.reply_tokens)
        generate_replies(model, model.text, prompts, path, args.reply_tokens, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
