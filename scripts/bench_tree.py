"""Token trees against chains: acceptance length and tokens/s, every chained draft, on this machine.

    python scripts/bench_tree.py --json benchmarks/trees/cpu.json

For each (target, draft) pair: the real SmolLM2-135M-Instruct (the packaged GGUF, float32) with its
EAGLE-3 draft (``--eagle3``), and the tiny models embedded in ``checkpoints/``: DeepSeek-V3 with its
MTP layer, Llama 3 with EAGLE-3 and with a draft model. Each runs plain, chains of K drafts (each
``--k``) and token trees of each ``--tree`` shape (DEPTH,TOPK,NODES), at each ``--batch`` and
``--temperature``, over the same prompts (SmolLM2: the held-out chat and code prompts of
``scripts/distill_data.py``, chat-rendered; the tiny models: code openings of the kind they were
trained on), ``--new-tokens`` tokens each past any end of turn. Rates are end to end (prefill
included), the median of ``--repeats`` timed runs after one untimed one (which compiles); the
acceptance length is the run's mean tokens per step. A progress line per configuration goes to
stderr; the results go to ``--json`` (rewritten after each configuration; a run given an existing
file resumes it, measuring only what it lacks) and a table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

TINY_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):",
    'class Queue:\n    """A first-in first-out queue."""\n\n    def __init__(self):',
    "for line in open(path):\n    if line.startswith('#'):",
]


def _pairs(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(label, draft, load keywords) of each (target, draft) pair asked for."""
    ck = os.path.join(REPO, "checkpoints")
    llama = os.path.join(ck, "tiny-llama3-stdlib")
    pairs = {
        "smollm2+eagle3": (
            "SmolLM2-135M + EAGLE-3",
            "eagle3",
            {"path": args.model, "draft_model": args.eagle3},
        ),
        "deepseek+mtp": (
            "tiny DeepSeek-V3 + MTP",
            "mtp",
            {"path": os.path.join(ck, "tiny-deepseek-v3-stdlib")},
        ),
        "llama+eagle3": (
            "tiny Llama 3 + EAGLE-3",
            "eagle3",
            {"path": llama, "draft_model": llama + "-eagle3"},
        ),
        "llama+draft": (
            "tiny Llama 3 + draft model",
            "draft_model",
            {"path": llama, "draft_model": llama + "-draft"},
        ),
    }
    return [(pairs[p][0], pairs[p][1], pairs[p][2]) for p in args.pairs]


def _prompts(model, real: bool, count: int) -> list[list[int]]:
    if real:
        from bench_real import prompt_ids

        from mtp_jax.text import TextCodec

        by_kind = prompt_ids(TextCodec.for_path(model.path), count)
        return [p for kind in ("chat", "code") for p in by_kind[kind]]
    return [model.text.encode(p) for p in TINY_PROMPTS[: 2 * count]]


def _measure(args, model, draft: str, prompts: list, extra: dict, batch: int, temperature: float) -> dict:
    """One configuration's rate and acceptance (``extra`` empty: plain decoding)."""
    from bench_real import timed

    stats: dict = {}

    def run() -> None:
        r = model.generate(
            prompts,
            max_new_tokens=args.new_tokens,
            ignore_eos=True,
            max_batch=batch,
            temperature=temperature,
            seed=0,
            **({"draft": draft, **extra} if extra else {}),
        )
        stats.update(r.stats)

    seconds = timed(run, args.repeats)
    return {
        "batch": batch,
        "temperature": temperature,
        "prompts": len(prompts),
        "tok_s": len(prompts) * args.new_tokens / seconds,
        "acceptance_length": stats.get("acceptance_length", 1.0),
        "acceptance_by_depth": stats.get("acceptance_rate_per_position", []),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=["smollm2+eagle3", "deepseek+mtp", "llama+eagle3", "llama+draft"],
        choices=["smollm2+eagle3", "deepseek+mtp", "llama+eagle3", "llama+draft"],
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the real target")
    parser.add_argument("--eagle3", default=os.path.join(REPO, "checkpoints", "smollm2-135m-instruct-eagle3"))
    parser.add_argument("--k", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--tree", nargs="+", default=["3,2,6", "3,2,10", "4,2,12", "4,3,24"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per kind (the tiny models: 2x)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", required=True, help="write the results here")
    args = parser.parse_args()

    import jax

    import mtp_jax
    from mtp_jax.bench import machine_info, write_json

    trees = []
    for text in args.tree:
        depth, topk, nodes = (int(x) for x in text.split(","))
        trees.append({"depth": depth, "topk": topk, "nodes": nodes})
    configs = [("plain", {})] + [(f"chain K={k}", {"num_speculative_tokens": k}) for k in args.k]
    configs += [(f"tree {t['depth']},{t['topk']},{t['nodes']}", {"speculative_tree": t}) for t in trees]
    report = {
        "command": " ".join(["python", "scripts/bench_tree.py", *sys.argv[1:]]),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **machine_info(),
        "rows": [],
    }
    done = set()
    if os.path.isfile(args.json):  # resume: keep what an interrupted run measured
        with open(args.json, encoding="utf-8") as f:
            report["rows"] = json.load(f)["rows"]
        done = {(r["pair"], r["config"], r["batch"], r["temperature"]) for r in report["rows"]}
        print(f"resuming {args.json}: {len(done)} configurations measured", file=sys.stderr)
    for label, draft, load in _pairs(args):
        load = dict(load)
        model = mtp_jax.load(load.pop("path"), "float32", **load)
        prompts = _prompts(model, label.startswith("SmolLM2"), args.prompts)
        for temperature in args.temperature:
            for batch in args.batch:
                for name, extra in configs:
                    if (label, name, batch, temperature) in done:
                        continue
                    row = _measure(args, model, draft, prompts, extra, batch, temperature)
                    report["rows"].append({"pair": label, "config": name, **row})
                    write_json(args.json, report)
                    jax.clear_caches()  # one process compiles every configuration: release each
                    gc.collect()
                    print(
                        f"[{label}] {name:16s} batch {batch} T={temperature}: {row['tok_s']:7.1f} tok/s, "
                        f"acceptance length {row['acceptance_length']:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
        del model
    for r in report["rows"]:
        print(
            f"{r['pair']:28s} {r['config']:16s} batch {r['batch']} T={r['temperature']}: "
            f"{r['tok_s']:7.1f} tok/s, acceptance length {r['acceptance_length']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
