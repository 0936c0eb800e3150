"""Model cards and eval.json records of trained checkpoints: the shared sentences every training
script's card uses (data, acceptance setup, usage), the exact command a run was started with, and
re-rendering a card from a checkpoint's config.json and eval.json (atomically)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

ACCEPTANCE_TOKENS = 64  # new tokens per held-out prompt when acceptance is measured (drafts compare)


def rewrite_card(directory: str, render: Callable[[dict, dict], str]) -> None:
    """Re-render a trained checkpoint's model card (README.md) from its config.json and eval.json
    with ``render(config, report)``."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(directory, "eval.json"), encoding="utf-8") as f:
        report = json.load(f)
    tmp = os.path.join(directory, f".README.md.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render(config, report))
    os.replace(tmp, os.path.join(directory, "README.md"))
    print(f"rewrote {directory}/README.md", file=sys.stderr)


def report_command() -> str:
    return " ".join(["python", f"scripts/{os.path.basename(sys.argv[0])}", *sys.argv[1:]])


def acceptance_setup(r: dict) -> str:
    """What a report's acceptance was measured on, for its card."""
    setup = r.get("acceptance_setup")
    if setup is None:
        return f"{ACCEPTANCE_TOKENS} new tokens on the target's held-out prompts"
    n, first = setup["new_tokens"], setup["prompts"]
    return f"{n} new tokens on the first {first} of the target's held-out prompts"


def data_sentence(d: dict) -> str:
    """The card's account of the training data: stdlib, chat or a corpus."""
    if d.get("kind") == "corpus":
        sampling = d.get("sampling", {})
        sources = ", ".join(
            f"{s} {row['conversations']:,}" for s, row in sorted(d["by_source"]["train"].items())
        )
        return (
            f"The target's own text: the self-distillation corpus `{d['corpus']}` ({d['shards']} shards; "
            f"{d['train_conversations']:,} conversations by source: {sources}; {d['train_tokens']:,} tokens, "
            f"{d['train_reply_tokens']:,} of them replies the target regenerated at temperature "
            f"{sampling.get('temperature')}, top-p {sampling.get('top_p')}); {d['heldout_conversations']} "
            f"conversations ({d['heldout_fraction']:.0%}, by a hash of their id) held out, their first turns "
            "the acceptance prompts. The corpus's CARD.md has its sources, licences and decontamination."
        )
    if d.get("kind") == "chat":
        return (
            f"The target's own text: {d['replies']}, to {d['train_prompts']:,} "
            f"chat and code prompts built from the {d['source']} ({d['train_tokens']:,} tokens of "
            f"conversation; {d['heldout_prompts']} prompts of held-out modules and topics kept out)."
        )
    return (
        f"{d['train_modules']} standard-library modules of Python {d['python']} ({d['train_tokens']:,} "
        f"tokens; the target's split, {d['heldout_modules']} modules held out)."
    )


def own_text_clause(d: dict, t: dict) -> str:
    """How much of each batch was the target's own greedy text (all of it, for chat or corpus data)."""
    if d.get("kind") in ("chat", "corpus"):
        return ""
    windows = f" from {t['own_text_windows']:,} windows" if t.get("own_text_windows") else ""
    return f"; {t['own_text']:.0%} of each batch{windows} of the target's own greedy continuations"


def usage_line(r: dict, method: str) -> str:
    """How to run the draft with its target."""
    if r["data"].get("kind") in ("chat", "corpus"):
        model = r.get("target_path", r["target"])
        ask = (  # a base model (no chat template) continues a text
            '--chat "Write a Python function that reverses a string."'
            if r["data"].get("chat_template", True)
            else '--prompt "def reverse_string(s):"'
        )
        return (
            f"    mtp-jax generate --model {model} --draft {method} \\\n"
            f"        --draft-model checkpoints/{r['name']} \\\n"
            f"        {ask}"
        )
    return (
        f"    mtp-jax generate --model checkpoints/{r['target']} --draft {method} --draft-model "
        f'checkpoints/{r["name"]} \\\n        --prompt "def main():"'
    )
