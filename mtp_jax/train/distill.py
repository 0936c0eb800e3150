"""Self-distillation data for drafts of a real chat model: prompts built offline, the target's replies
(``scripts/distill_data.py`` generates the replies ahead of a training run).

A draft is judged by how often the target accepts its tokens, so it is trained on the target's own
text: chat prompts rendered with the target's chat template, each followed by the target's greedy
reply (generated once through mtp-jax, kept on disk, resumable).

The prompts come from material every Python installation carries, nothing downloaded:

* ``code``: public functions and classes of the standard library with a docstring, asked for as
  "Write a Python function `name(args)` that <its docstring's summary>" and the like;
* ``chat``: questions about those modules ("What does the `json` module do?"), requests to explain
  a docstring's first paragraph in simple words, and to summarise a paragraph of the Python
  reference documentation that ships with the interpreter (``pydoc_data.topics``).

Modules are split into training and held-out ones as the tiny models' data is (5% by the hash of
the module's path; :func:`mtp_jax.train.data.stdlib_modules`), documentation topics by the hash of their name;
the held-out prompts (``heldout_prompts``) are never trained on and are what acceptance and the
benchmarks measure. Everything is deterministic given the Python version.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import time

import numpy as np

from mtp_jax.train.data import HELDOUT_PERCENT, read_text, stdlib_modules

SOURCE = (
    "Python {version} standard library: docstrings of public functions, classes and modules, and the "
    "reference documentation in pydoc_data.topics (prompt templates in mtp_jax/train/distill.py)"
)


def _pick(key: str, n: int) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % n


def _summary(doc: str) -> str | None:
    """A docstring's first sentence, when it reads like prose."""
    first = doc.strip().split("\n\n")[0]
    first = " ".join(first.split())
    m = re.match(r"(.{20,200}?[.!?])(\s|$)", first)
    if not m or first.startswith((">>>", "..", ":", "(")) or "::" in first:
        return None
    return m.group(1)


def _paragraph(doc: str) -> str | None:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text if 80 <= len(text) <= 700 else None


def _module_name(rel: str) -> str:
    name = rel[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[1:2].islower() or len(s) == 1 else s


def module_prompts(module: str, source: str) -> list[dict]:
    """Prompts about one module's public, documented functions and classes, and the module itself."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    doc = ast.get_docstring(tree)
    if doc and (summary := _summary(doc)) and not module.split(".")[-1].startswith("_"):
        kind = _pick(module, 2)
        text = (
            f"What does the `{module}` module in Python's standard library do?"
            if kind == 0
            else f'I found this description of a Python module: "{summary}" What is it used for?'
        )
        out.append({"kind": "chat", "text": text})
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not (summary := _summary(doc)):
            continue
        name = f"{module}.{node.name}"
        choice = _pick(name, 5)
        if isinstance(node, ast.FunctionDef):
            params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            sig = f"{node.name}({', '.join(params)})"
            code = [
                f"Write a Python function `{sig}` that does the following: {summary}",
                f"Implement `{sig}` in Python. {summary} Keep it short.",
                f"How do I use `{name}` in Python? Show a short example.",
            ]
        else:
            code = [
                f"Write a small Python class `{node.name}`. {summary}",
                f"Show how to use the `{name}` class in Python with a short example.",
                f"Write a minimal Python version of `{node.name}`: {_lower_first(summary)}",
            ]
        para = _paragraph(doc)
        if choice < 3:
            out.append({"kind": "code", "text": code[choice]})
        elif choice == 3 and para:
            out.append({"kind": "chat", "text": f"Explain this in simple words:\n\n{para}"})
        else:
            out.append({"kind": "chat", "text": f"{summary} Can you explain what that means?"})
    return out


def topic_prompts(name: str, text: str) -> list[dict]:
    """Summarising requests for paragraphs of one reference-documentation topic."""
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    paras = [p for p in paras if 200 <= len(p) <= 900 and not p.startswith(("*", "-", ">>>"))]
    return [{"kind": "chat", "text": f"Summarize the following in two sentences:\n\n{p}"} for p in paras[:4]]


def build_prompts(max_files: int | None = None) -> tuple[list[dict], list[dict]]:
    """(training prompts in a fixed shuffled order, held-out prompts): dicts with "kind" ("chat" or
    "code") and "text"."""
    import pydoc_data.topics

    root, train_files, held_files = stdlib_modules(max_files)
    train, held = [], []
    for files, out in ((train_files, train), (held_files, held)):
        for rel in files:
            out += module_prompts(_module_name(rel), read_text(root, rel))
    topics = sorted(pydoc_data.topics.topics.items())
    if max_files:
        topics = topics[:max_files]
    for name, text in topics:
        (held if _pick(name, 100) < HELDOUT_PERCENT else train).extend(topic_prompts(name, text))
    seen: set[str] = set()
    for out in (held, train):  # a prompt that is also held out is not trained on
        out[:] = [p for p in out if not (p["text"] in seen or seen.add(p["text"]))]
    # modules mixed: any prefix of the list is a fair sample
    train.sort(key=lambda p: hashlib.sha256(p["text"].encode()).hexdigest())
    return train, held


def heldout_prompts(count_per_kind: int, max_files: int | None = None) -> list[dict]:
    """``count_per_kind`` held-out chat prompts and as many code ones, in a fixed spread-out order."""
    _, held = build_prompts(max_files)
    out = []
    for kind in ("chat", "code"):
        mine = [p for p in held if p["kind"] == kind]
        picks = np.linspace(0, len(mine) - 1, min(count_per_kind, len(mine))).astype(int)
        out += [mine[i] for i in sorted(set(picks.tolist()))]
    return out


def edit_prompts(count: int, max_files: int | None = None) -> list[dict]:
    """``count`` held-out requests whose answer repeats the input (kind "edit"): a short public
    function of a held-out module, its docstring removed, to be returned whole with one added: the
    kind of task prompt lookup (n-gram drafts) is for. Never trained on; a fixed spread-out order."""
    root, _, held_files = stdlib_modules(max_files)
    found = []
    for rel in held_files:
        source = read_text(root, rel)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            body = node.body
            if ast.get_docstring(node) is None or len(body) < 2 or node.decorator_list:
                continue
            head = lines[node.lineno - 1 : body[0].lineno - 1]
            rest = lines[body[1].lineno - 1 : node.end_lineno]
            if not 5 <= len(head) + len(rest) <= 25:
                continue
            code = "\n".join(head + rest)
            found.append(
                {
                    "kind": "edit",
                    "text": "Add a docstring to this Python function. Reply with the complete function only."
                    f"\n\n```python\n{code}\n```",
                }
            )
    picks = np.linspace(0, len(found) - 1, min(count, len(found))).astype(int)
    return [found[i] for i in sorted(set(picks.tolist()))]


def generate_replies(
    model, codec, prompts: list[dict], path: str, max_new_tokens: int, batch: int = 32
) -> list[list[int]]:
    """The target's greedy reply (token ids, EOS included when it ended) to each chat-rendered
    prompt, appended to ``path`` (JSON lines: the prompt and its reply) batch by batch: a rerun
    resumes where it stopped, from the lines whose prompts are still the same. Lines past the
    prompts asked for (a run over more of the same prompts: ``--max-prompts``) are kept; the file
    is cut only at a line that no longer holds (another prompt, or a line an interruption cut
    short), rewritten whole under a temporary name and renamed."""
    done: list[list[int]] = []
    if os.path.isfile(path):
        stale = False
        with open(path, encoding="utf-8") as f:
            for line, p in zip(f, prompts, strict=False):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    stale = True  # a line cut short by an interruption: regenerate from there
                    break
                if row.get("prompt") != p["text"]:
                    stale = True  # another prompt set: regenerate from here
                    break
                done.append(row["reply"])
        if stale:  # keep only what still holds
            temporary = f"{path}.tmp{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as f:
                f.writelines(
                    json.dumps({"prompt": p["text"], "reply": r}) + "\n"
                    for p, r in zip(prompts, done, strict=False)
                )
            os.replace(temporary, path)
    t0, start = time.perf_counter(), len(done)
    with open(path, "a", encoding="utf-8") as f:
        for i in range(len(done), len(prompts), batch):
            chunk = prompts[i : i + batch]
            ids = [codec.encode_chat([{"role": "user", "content": p["text"]}]) for p in chunk]
            result = model.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0, max_batch=batch)
            for p, r in zip(chunk, result.tokens, strict=True):
                f.write(json.dumps({"prompt": p["text"], "reply": [int(t) for t in r]}) + "\n")
                done.append([int(t) for t in r])
            f.flush()
            rate = sum(len(r) for r in done[start:]) / (time.perf_counter() - t0)
            left = (len(prompts) - len(done)) / max(len(done) - start, 1) * (time.perf_counter() - t0)
            print(
                f"replies {len(done)}/{len(prompts)}, {rate:.0f} tokens/s, ETA {left / 60:.0f} min",
                file=sys.stderr,
                flush=True,
            )
    return done


def conversation_stream(
    codec, prompts: list[dict], replies: list[list[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """One int32 stream of the conversations (chat-rendered prompt, then the target's reply) and
    where each conversation starts in it."""
    parts = [
        np.asarray(codec.encode_chat([{"role": "user", "content": p["text"]}]) + r, np.int32)
        for p, r in zip(prompts, replies, strict=True)
    ]
    starts = np.cumsum([0] + [len(x) for x in parts[:-1]]).astype(np.int64)
    return np.concatenate(parts), starts


def replies_path(directory: str, target: str, split: str, reply_tokens: int) -> str:
    """Where a target's replies are kept: shared by every draft trained in ``directory``."""
    name = os.path.basename(os.path.normpath(target)).removesuffix(".gguf")
    return os.path.join(directory, f"replies-{name}-{split}-{reply_tokens}.jsonl")
