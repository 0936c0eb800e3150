"""Build a self-distillation corpus for a target's drafts: prompts from ShareGPT (chat),
reasoning-gym (math) and the standard library (code, mtp_jax/train/distill.py's training prompts),
decontaminated against mtp_jax/evalsets, answered by the target itself (mtp_jax.train).

Resumable: rerun the same command and it goes on from the shards already written.

    python scripts/build_corpus.py --target-tokens 5000000              # the full run
    python scripts/build_corpus.py --limit 256 --measure-slots 16,32,64  # pick the slot count
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="the model that answers (name or path)")
    p.add_argument("--out", help="the corpus directory (default: training/corpus-TARGET)")
    p.add_argument("--limit", type=int, help="only the first N conversations of the plan")
    p.add_argument("--slots", type=int, default=16, help="the engine's batch (continuous batching)")
    p.add_argument("--target-tokens", type=int, help="stop once this many reply tokens are written")
    p.add_argument("--max-new-tokens", type=int, default=512, help="per reply")
    p.add_argument("--context-cap", type=int, default=2048, help="tokens per conversation, all turns")
    p.add_argument("--shard-size", type=int, default=16, help="conversations per shard (a few minutes each)")
    p.add_argument("--math-count", type=int, default=9000, help="reasoning-gym questions offered")
    p.add_argument("--seed", type=int, default=0, help="the mix's and the sampling's seed")
    sampling = "(default: as the target's own documentation recommends for a packaged model, "
    p.add_argument("--temperature", type=float, help=sampling + "else 0.2)")
    p.add_argument("--top-p", type=float, help=sampling + "else 0.9)")
    p.add_argument("--top-k", type=int, help=sampling + "else 0: off)")
    p.add_argument("--min-p", type=float, help=sampling + "else 0: off)")
    p.add_argument("--dtype", default="float32", help="float32 on a CPU (16-bit caches are slow there)")
    p.add_argument(
        "--measure-slots",
        help="comma-separated slot counts: regenerate the first --limit conversations at each, "
        "print reply tokens/s, record it in the manifest, and exit",
    )
    p.add_argument("--measure-seconds", type=float, default=480, help="per slot count")
    p.add_argument(
        "--jit-cache",
        default=os.path.join(os.path.expanduser("~"), ".cache", "mtp-jax-corpus-jit"),
        help="JAX's persistent compilation cache: a resumed run skips recompiling ('' disables)",
    )
    args = p.parse_args()
    name = os.path.basename(os.path.normpath(args.target)).removesuffix(".gguf")
    args.out = args.out or os.path.join(REPO, "training", f"corpus-{name}")
    if args.jit_cache and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        # set before JAX starts; a 30-layer model's programs take minutes to compile on a busy CPU
        os.environ["JAX_COMPILATION_CACHE_DIR"] = args.jit_cache
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")

    import mtp_jax
    from mtp_jax import evalsets
    from mtp_jax.train import (
        Decontaminator,
        Settings,
        build_plan,
        chat_prompts,
        code_prompts,
        generate_corpus,
        math_prompts,
        measure_slots,
        sampling_for,
    )

    command = "python scripts/build_corpus.py " + shlex.join(sys.argv[1:])
    t0 = time.perf_counter()
    model = mtp_jax.load(args.target, args.dtype)
    codec = model.text
    given = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p")}
    chosen, sampling_source = sampling_for(args.target, {k: v for k, v in given.items() if v is not None})
    settings = Settings(
        **chosen,
        max_new_tokens=args.max_new_tokens,
        context_cap=args.context_cap,
        seed=args.seed,
    )

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in codec.tokenizer.encode_batch(texts, add_special_tokens=False)]

    from mtp_jax.train.distill import build_prompts  # the standard-library prompts; held-out ones never used

    train, _ = build_prompts()
    chat, chat_record = chat_prompts()
    math, math_record = math_prompts(args.math_count, seed=args.seed + 1000)
    origin = "scripts/distill_data.py training prompts (held-out excluded)"  # the label the corpus began with
    code, code_record = code_prompts((q["text"] for q in train), origin=origin)
    decontaminator = Decontaminator(evalsets.read_all(), encode)
    plan = build_plan(
        {"chat": chat, "math": math, "code": code},
        decontaminator,
        seed=args.seed,
        max_first_turn_tokens=args.context_cap - 64 - settings.min_reply_tokens,
        source_records={"chat": chat_record, "math": math_record, "code": code_record},
    )
    print(
        f"plan: {len(plan.prompts):,} conversations in {time.perf_counter() - t0:.0f} s; "
        + "; ".join(
            f"{name}: {row['in_mix']:,} (decontamination removed {row['decontaminated_removed']:,})"
            for name, row in plan.record["sources"].items()
        ),
        file=sys.stderr,
        flush=True,
    )
    if args.measure_slots:
        sample = plan.prompts[: args.limit or 256]
        slot_counts = [int(s) for s in args.measure_slots.split(",")]
        rows = measure_slots(
            model, sample, slot_counts, settings, target=args.target, seconds=args.measure_seconds
        )
        import json

        path = os.path.join(args.out, "slot-measurement.json")
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"command": command, "settings": vars(args), "results": rows}, f, indent=1)
        print(f"slot measurement written to {path}", file=sys.stderr)
        return 0
    extra = {"sampling_source": sampling_source}
    measured = os.path.join(args.out, "slot-measurement.json")
    if os.path.isfile(measured):
        import json

        with open(measured, encoding="utf-8") as f:
            extra["slot_measurement"] = json.load(f)["results"]
    generate_corpus(
        model,
        plan,
        args.out,
        settings,
        target=args.target,
        slots=args.slots,
        shard_size=args.shard_size,
        limit=args.limit,
        target_tokens=args.target_tokens,
        command=command,
        extra=extra,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
