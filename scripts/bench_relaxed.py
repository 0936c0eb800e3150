"""Relaxed acceptance inside a thinking phase: the acceptance it gains and what it costs.

Each held-out prompt ends with the think-start marker, so everything generated is inside the phase
(the end marker is a token the model does not produce). For each (relaxed_topk, relaxed_delta), on
the same prompts in one run (configurations interleaved as in ``mtp-jax bench``):

- acceptance length and decode tokens/s (greedy, argmax drafts);
- how far the text stays the strict output's (mean length of the common prefix, as a fraction of
  the generated length) and the target's mean log-probability of what was generated (strict
  greedy's is the reference): the relaxation is lossy by design, this says by how much;
- the same settings with the markers absent: acceptance must equal strict (checked, not assumed).

    python scripts/bench_relaxed.py --k 3 --batch 1 --json benchmarks/relaxed.json
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax.bench import held_out_prompts, machine_info, measure, model_path, write_json  # noqa: E402
from mtp_jax.request import thinking_markers  # noqa: E402

SETTINGS = [(0, 0.0), (2, 0.1), (2, 0.3), (4, 0.3), (8, 0.5), (8, 1.0)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _mean_logprob(model, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """The target's mean log-probability of the generated tokens (teacher-forced)."""
    total, count = 0.0, 0
    for p, o in zip(prompts, outputs, strict=True):
        lp = model.score(p + o).logprobs[len(p) - 1 :]
        total += float(np.sum(lp))
        count += len(lp)
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--draft-model", help="a separately trained draft (EAGLE-3 or DFlash) beside the target")
    p.add_argument("--draft", default=None, help="draft method (default: the model's last)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32, help="random prompts (no eval.json) only")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--think-tokens",
        type=int,
        nargs=2,
        metavar=("START", "END"),
        help="marker ids (default: the tokenizer's <think> and </think>, else the last two ids)",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import mtp_jax

    path = model_path(args.model)
    model = mtp_jax.load(path, dtype=args.dtype, draft_model=args.draft_model)
    draft = args.draft or model.drafts[-1]
    v = model.config.vocab_size
    if args.think_tokens:
        start, end = args.think_tokens
    else:
        try:
            start, end = thinking_markers(model, None)
        except ValueError:
            start, end = v - 2, v - 1
    prompts, note = held_out_prompts(model, path, args)
    thinking = [[*q, start] for q in prompts]
    configs, keys = [], []
    for topk, delta in SETTINGS:
        spec = dict(draft=draft, num_speculative_tokens=args.k, think_tokens=(start, end))
        spec.update(relaxed_topk=topk, relaxed_delta=delta)
        configs.append((model, spec))
        keys.append((topk, delta))
    print(f"{len(configs)} settings, K = {args.k}, batch {args.batch} ...", file=sys.stderr, flush=True)
    measured = dict(zip(keys, measure(thinking, args, args.batch, configs), strict=True))

    def outputs(prompt_set, spec) -> tuple[list[list[int]], dict]:
        out = model.generate(
            prompt_set, max_new_tokens=args.new_tokens, ignore_eos=True, max_batch=args.batch, **spec
        )
        return out.tokens, out.stats

    strict_tokens, _ = outputs(thinking, configs[0][1])
    outside_strict, _ = outputs(prompts, configs[0][1])
    rows = []
    for (topk, delta), (_, spec) in zip(keys, configs, strict=True):
        tokens, _ = outputs(thinking, spec)
        outside, outside_stats = outputs(prompts, spec)
        prefix = np.mean([_common_prefix(a, b) / len(b) for a, b in zip(tokens, strict_tokens, strict=True)])
        rows.append(
            {
                "relaxed_topk": topk,
                "relaxed_delta": delta,
                "acceptance_length": measured[(topk, delta)]["stats"]["acceptance_length"],
                "decode_tok_s": measured[(topk, delta)]["decode_tok_s"],
                "same_prefix_fraction": float(prefix),
                "target_mean_logprob": _mean_logprob(model, thinking, tokens),
                "outside_phase_equals_strict": outside == outside_strict,
                "outside_phase_acceptance_length": outside_stats["acceptance_length"],
            }
        )
    base = rows[0]
    print(f"{'topk':>4} {'delta':>5} {'accept':>7} {'tok/s':>8} {'vs strict':>9} {'same prefix':>11} "
          f"{'logprob':>8} {'outside = strict':>16}")  # fmt: skip
    for r in rows:
        print(
            f"{r['relaxed_topk']:>4} {r['relaxed_delta']:>5.2f} {r['acceptance_length']:>7.2f} "
            f"{r['decode_tok_s']:>8.1f} {r['decode_tok_s'] / base['decode_tok_s']:>9.2f} "
            f"{r['same_prefix_fraction']:>11.2f} {r['target_mean_logprob']:>8.3f} "
            f"{str(r['outside_phase_equals_strict']):>16}"
        )
    report = {
        "model": os.path.basename(os.path.abspath(path)),
        "draft": draft,
        "k": args.k,
        "batch": args.batch,
        "think_tokens": [start, end],
        "prompts": note,
        "prompts_per_run": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **machine_info(),
        "results": rows,
    }
    if args.json:
        write_json(args.json, report)
    return 0 if all(r["outside_phase_equals_strict"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
