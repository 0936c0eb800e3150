"""What structured output costs: decode rates with and without a grammar, and where the time goes.

For each batch size and draft configuration, on the model's held-out prompts (one run, the
configurations interleaved as in ``mtp-jax bench``):

- ``free``: no grammar, the engine's default pipeline (step n+1 dispatched before step n is read);
- ``free, synchronous``: no grammar, but every step read before the next is dispatched: the host
  round trip a grammar imposes, without any mask work (``generate(pipelined=False)``);
- ``any text``: a grammar that admits any text (regex ``(.|\\n)*``): the whole grammar machinery
  (masks along the drafts, matchers, the masked step) on about the tokens of ``free``;
- ``json``: a JSON schema (an array of records): a realistic constraint (different tokens, so its
  acceptance differs);

each grammar with its masks delivered by the host between steps (``host``) and by an ordered
callback inside the step (``callback``).

Reports decode tokens/s, the ratio to ``free``, acceptance length, and the host's grammar time per
step. The difference ``free`` - ``free, synchronous`` bounds what any other way of delivering the
masks (a host callback inside the step, the host preparing step n+1 while n runs) could win back.

    python scripts/bench_grammar.py --batch 1 8 --k 0 3 --json benchmarks/grammar.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax.bench import held_out_prompts, machine_info, measure, model_path, write_json  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "line": {"type": "integer"},
            "kind": {"enum": ["def", "class", "import"]},
        },
        "required": ["name", "line", "kind"],
        "additionalProperties": False,
    },
}
ANY = {"regex": "(.|\n)*"}
MODES = {
    "free": {},
    "free, synchronous": {"pipelined": False},
    "any text, host": {"grammar": ANY},
    "any text, callback": {"grammar": ANY, "grammar_masks": "callback"},
    "json, host": {"grammar": {"json_schema": SCHEMA}},
    "json, callback": {"grammar": {"json_schema": SCHEMA}, "grammar_masks": "callback"},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--draft-model", help="a separately trained draft (EAGLE-3 or DFlash) beside the target")
    p.add_argument("--draft", default=None, help="draft method (default: the model's first)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, nargs="+", default=[0, 3], help="drafts per step (0 = plain)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32, help="random prompts (no eval.json) only")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import mtp_jax

    path = model_path(args.model)
    model = mtp_jax.load(path, dtype=args.dtype, draft_model=args.draft_model)
    draft = args.draft or (model.drafts[-1] if model.drafts else None)
    if max(args.k) and draft is None:
        p.error(f"{path} has no draft: only --k 0")
    prompts, note = held_out_prompts(model, path, args)
    rows = []
    for batch in args.batch:
        configs, keys = [], []
        for k in args.k:
            spec = {"temperature": args.temperature}
            if k:
                spec.update(draft=draft, num_speculative_tokens=k)
            for mode, extra in MODES.items():
                configs.append((model, {**spec, **extra}))
                keys.append((k, mode))
        print(f"batch {batch}: K = {args.k}, {len(configs)} configurations ...", file=sys.stderr, flush=True)
        measured = dict(zip(keys, measure(prompts, args, batch, configs), strict=True))
        for (k, mode), m in measured.items():
            st = m["stats"]
            rows.append(
                {
                    "batch": batch,
                    "k": k,
                    "mode": mode,
                    "decode_tok_s": m["decode_tok_s"],
                    "vs_free": m["decode_tok_s"] / measured[(k, "free")]["decode_tok_s"],
                    "acceptance_length": st["acceptance_length"],
                    "steps": st["steps"],
                    "grammar_ms_per_step": 1e3 * st.get("grammar_seconds", 0.0) / max(st["steps"], 1),
                }
            )
    report = {
        "model": os.path.basename(os.path.abspath(path)),
        "draft": draft,
        "draft_model": args.draft_model,
        "prompts": note,
        "prompts_per_run": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "temperature": args.temperature,
        **machine_info(),
        "results": rows,
    }
    print(
        f"{'batch':>5} {'K':>2} {'mode':<20} {'tok/s':>8} {'vs free':>8} {'accept':>7} "
        f"{'grammar ms/step':>15}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['k']:>2} {r['mode']:<20} {r['decode_tok_s']:>8.1f} {r['vs_free']:>8.2f} "
            f"{r['acceptance_length']:>7.2f} {r['grammar_ms_per_step']:>15.2f}"
        )
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
