"""LoRA adapters' cost: decode tokens/s with no adapter, one adapter on every row and a different
adapter per row, against the same model without LoRA (what merging an adapter into the weights
runs at: the same shapes as the base model's).

    python scripts/bench_lora.py --json benchmarks/lora/smollm2.json --rank 16 64 --batch 1 8

SmolLM2-135M-Instruct (float32, ``--model``) with random adapters (``--adapters`` of them, rank
``--rank``, on every projection: q/k/v/o and gate/up/down) written in PEFT's layout; the held-out
chat and code prompts of ``scripts/bench_real.py``, greedy, ``--new-tokens`` each, ignoring EOS.
Each configuration runs once untimed (compiling) and then ``--repeats`` times; the median is kept.

``--step``: time the jitted step alone instead (:func:`mtp_jax.roofline.time_step`, the program
generation runs, at a committed length of ``--context`` tokens), alternating the model without
LoRA and the model with ``--adapters`` adapters one per row ``--alternations`` times in one
process (separate runs of one program move by 10-15% on these machines); ``--profile DIR`` traces
the adapted step there with :mod:`jax.profiler` and prints its costliest operations.

    python scripts/bench_lora.py --step --json benchmarks/lora/smollm2-step.json --rank 8 16 64 --batch 1 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, nargs="+", default=[16])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[0], help="n-gram drafts per step (0: plain)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", required=True)
    parser.add_argument("--step", action="store_true", help="time the jitted step alone (see above)")
    parser.add_argument("--context", type=int, default=256, help="--step: the rows' committed length")
    parser.add_argument("--alternations", type=int, default=3, help="--step: rounds of A/B")
    parser.add_argument("--iters", type=int, default=10, help="--step: steps per timed round")
    parser.add_argument("--profile", default=None, help="--step: trace the adapted step into this directory")
    args = parser.parse_args()

    import bench_real

    import mtp_jax
    from mtp_jax.bench import machine_info, write_json
    from mtp_jax.embedded import resolve_model_path
    from mtp_jax.synthetic import write_lora_adapter
    from mtp_jax.text import TextCodec

    codec = TextCodec.for_path(resolve_model_path(args.model))
    by_kind = bench_real.prompt_ids(codec, max(args.batch) // 2 or 1)
    prompts = [p for kind in ("chat", "code") for p in by_kind[kind]][: max(args.batch)]
    base = mtp_jax.load(args.model, "float32")
    rows = []

    def timed(model, batch: int, k: int, lora) -> float:
        kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True, max_batch=batch)
        if k:
            kw.update(draft="ngram", num_speculative_tokens=k)
        if lora is not None:
            kw["lora"] = lora[: len(prompts)] if isinstance(lora, list) else lora
        model.generate(prompts, **kw)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model.generate(prompts, **kw)
            times.append(time.perf_counter() - t0)
        return len(prompts) * args.new_tokens / statistics.median(times)

    with tempfile.TemporaryDirectory() as tmp:
        for rank in args.rank:
            paths = {
                f"a{i}": write_lora_adapter(
                    os.path.join(tmp, f"r{rank}-{i}"), base.config, rank, MODULES, i, alpha=rank, b_std=0.01
                )
                for i in range(args.adapters)
            }
            model = mtp_jax.load(args.model, "float32", lora_adapters=paths, max_lora_rank=rank)
            names = list(paths)
            if args.step:
                rows += step_rows(args, base, model, rank)
                del model
                continue
            for batch in args.batch:
                for k in args.k:
                    configs = [
                        ("no LoRA (= merged weights)", base, None),
                        ("LoRA slots, no adapter", model, None),
                        ("one adapter, every row", model, names[0]),
                        (
                            f"{args.adapters} adapters, one per row",
                            model,
                            [names[i % len(names)] for i in range(len(prompts))],
                        ),
                    ]
                    for label, m, lora in configs:
                        tok_s = timed(m, batch, k, lora)
                        row = {"rank": rank, "batch": batch, "k": k, "config": label, "tok_s": tok_s}
                        rows.append(row)
                        print(row, file=sys.stderr, flush=True)
            del model
    write_json(args.json, {"command": " ".join(sys.argv), **machine_info(), "rows": rows})
    return 0


def step_rows(args, base, model, rank: int) -> list[dict]:
    """Step seconds without LoRA and with the adapters one per row, alternated in this process."""
    from mtp_jax.model import DTYPES
    from mtp_jax.roofline import device_op_times, time_step

    slots = sorted(model.lora.slots.values())
    out = []
    for batch in args.batch:
        for k in args.k:
            rows = [slots[i % len(slots)] for i in range(batch)]
            configs = {"no LoRA": (base, None), f"{len(slots)} adapters, one per row": (model, rows)}
            runs: dict[str, list[float]] = {label: [] for label in configs}
            for turn in range(args.alternations):
                for label, (m, lora_slots) in configs.items():
                    profile = None
                    if args.profile and lora_slots is not None and turn == args.alternations - 1:
                        profile = os.path.join(args.profile, f"r{rank}-b{batch}-k{k}")
                    seconds = time_step(
                        m.params,
                        m.config,
                        k=k,
                        batch=batch,
                        context=args.context,
                        page_size=m.page_size,
                        dtype=DTYPES[m.dtype],
                        iters=args.iters,
                        draft="ngram" if k else None,
                        lora_slots=lora_slots,
                        profile_dir=profile,
                    )
                    runs[label].append(seconds)
                    if profile:
                        for op in device_op_times(profile)[:15]:
                            line = f"  {op['us_per_step']:9.1f} us {op['share']:6.1%}  {op['name']}"
                            print(line, file=sys.stderr)
            base_s, lora_s = (statistics.median(t) for t in runs.values())
            row = {
                "rank": rank,
                "batch": batch,
                "k": k,
                "context": args.context,
                "step_ms": {label: [round(t * 1e3, 3) for t in times] for label, times in runs.items()},
                "ratio": lora_s / base_s,
            }
            print(row, file=sys.stderr, flush=True)
            out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
