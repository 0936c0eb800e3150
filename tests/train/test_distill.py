"""mtp_jax.train.distill: the prompt sets a real model's drafts are trained and benchmarked on."""

from __future__ import annotations

import ast

from mtp_jax.train import data, distill


def test_edit_prompts_are_held_out_functions_to_repeat_without_their_docstrings():
    prompts = distill.edit_prompts(5)
    assert len(prompts) == 5 and prompts == distill.edit_prompts(5)  # deterministic
    root, _, held_files = data.stdlib_modules()
    held = "".join(data.read_text(root, rel) for rel in held_files)  # never trained on
    for p in prompts:
        assert p["kind"] == "edit"
        code = p["text"].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        (fn,) = ast.parse(code).body  # one whole function, as written in its module
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn) is None
        assert 5 <= len(code.splitlines()) <= 25 and all(line in held for line in code.splitlines())


def test_replies_of_fewer_prompts_keep_the_longer_runs_lines(tmp_path):
    """A run over the first prompts of a replies file (--max-prompts) reads them and leaves the rest
    of the file alone; a changed prompt cuts the file there (rewritten whole, nothing half-written)."""
    import json

    from mtp_jax.train.distill import generate_replies

    path = tmp_path / "replies.jsonl"
    prompts = [{"text": f"prompt {i}"} for i in range(5)]
    lines = [json.dumps({"prompt": p["text"], "reply": [i, i + 1]}) + "\n" for i, p in enumerate(prompts)]
    path.write_text("".join(lines))
    assert generate_replies(None, None, prompts[:2], str(path), 8) == [[0, 1], [1, 2]]  # nothing generated
    assert path.read_text() == "".join(lines)  # the other three kept
    changed = [prompts[0], {"text": "another"}]

    class Model:  # the target: answers each new prompt with [7]
        def generate(self, ids, **kw):
            return type("R", (), {"tokens": [[7] for _ in ids]})()

    class Codec:
        def encode_chat(self, messages):
            return [1, 2]

    assert generate_replies(Model(), Codec(), changed, str(path), 8) == [[0, 1], [7]]
    assert path.read_text() == lines[0] + json.dumps({"prompt": "another", "reply": [7]}) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replies.jsonl"]
