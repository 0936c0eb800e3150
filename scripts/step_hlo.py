"""Fingerprints of the compiled step: the optimised HLO of prefill and the step, without metadata.

A change that should not touch the math (a move of modules, a rename) must leave these programs
identical. Run it before and after and compare the JSON files:

    python scripts/step_hlo.py --out /tmp/before.json      # on the old commit
    python scripts/step_hlo.py --out /tmp/after.json --compare /tmp/before.json

Each program is the one ``generate`` runs (``step_config`` of the model and speculation), lowered
and compiled for a batch of 4 at float32; its text loses the ``metadata={...}`` of each
instruction, the tables of source files, functions and stack frames they point into, and the
parameters' names (which a move or a rename of a field changes) before it is hashed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = (
    ("tiny-deepseek-v3-stdlib", None, "none", 0),
    ("tiny-deepseek-v3-stdlib", None, "mtp", 3),
    ("tiny-llama3-stdlib", "tiny-llama3-stdlib-eagle3", "eagle3", 3),
    ("tiny-llama3-stdlib", "tiny-llama3-stdlib-dflash", "dflash", 4),
)
_METADATA = re.compile(r",? ?metadata=\{[^{}]*\}")
# the tables of source files, functions and stack frames that the metadata points into
_DEBUG_TABLES = re.compile(r"\nFileNames\n.*?\nStackFrames\n.*?\n\n", re.S)


_PARAMETER = re.compile(r"%([\w.\-]+) = [^\n]*? parameter\((\d+)\)")


def normalise(text: str) -> str:
    """The program without what a rename or a move changes and the math does not: instruction
    metadata, the debug tables, and parameter names (taken from the pytree's field names: each
    becomes ``p<its number>``)."""
    text = _DEBUG_TABLES.sub("\n", _METADATA.sub("", text))
    names = {}
    for name, number in _PARAMETER.findall(text):
        names[name] = f"p{number}"
    if names:
        pattern = re.compile(
            r"(?<![\w.\-])("
            + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
            + r")(?![\w\-]|\.\d)"
        )
        text = pattern.sub(lambda m: names[m.group(1)], text)
    return text


def fingerprints(cases: int = len(CASES), texts: str | None = None) -> dict[str, str]:
    import jax.numpy as jnp
    import numpy as np

    import mtp_jax
    from mtp_jax.request import SpeculativeConfig, step_config
    from mtp_jax.sampling import RowSampling
    from mtp_jax.step import init_state, prefill, step

    out = {}
    for target, draft_dir, draft, k in CASES[:cases]:
        path = os.path.join(REPO, "checkpoints", target)
        draft_path = os.path.join(REPO, "checkpoints", draft_dir) if draft_dir else None
        model = mtp_jax.load(path, "float32", draft_model=draft_path)
        spec = SpeculativeConfig() if k == 0 else SpeculativeConfig(draft=draft, num_speculative_tokens=k)
        sc = step_config(model, spec)
        b, width, bucket = 4, 8, 16
        state = init_state(sc, b, b * width, width, jnp.float32)
        prefill_args = (
            model.params,
            state,
            sc,
            jnp.arange(b, dtype=jnp.int32),
            np.ones((b, bucket), np.int32),
            jnp.full((b,), bucket, jnp.int32),
            jnp.arange(b * width, dtype=jnp.int32).reshape(b, width),
            RowSampling.build(b),
        )
        for name, fn, args in (("prefill", prefill, prefill_args), ("step", step, (model.params, state, sc))):
            text = normalise(fn.trace(*args).lower().compile().as_text())
            out[f"{target}/{draft}/K={k}/{name}"] = hashlib.sha256(text.encode()).hexdigest()
            if texts:
                os.makedirs(texts, exist_ok=True)
                name_of = os.path.join(texts, f"{target}-{draft}-K{k}-{name}.hlo")
                with open(name_of, "w", encoding="utf-8") as f:
                    f.write(text)
            print(f"{target:24s} {draft:7s} K={k} {name:8s} {out[f'{target}/{draft}/K={k}/{name}'][:16]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", default=None, help="a JSON file of an earlier run: exit 1 unless equal")
    parser.add_argument("--cases", type=int, default=len(CASES), help="only the first this many cases")
    parser.add_argument("--texts", default=None, help="also write each program's text into this folder")
    args = parser.parse_args(argv)
    found = fingerprints(args.cases, args.texts)
    with open(f"{args.out}.tmp", "w", encoding="utf-8") as f:
        json.dump(found, f, indent=1)
    os.replace(f"{args.out}.tmp", args.out)
    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            before = json.load(f)
        differ = sorted(k for k in set(before) | set(found) if before.get(k) != found.get(k))
        print("identical" if not differ else "differ: " + ", ".join(differ))
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
