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
