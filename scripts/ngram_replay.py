"""Replay a model's greedy replies through the n-gram lookup: acceptance without timing.

    python scripts/ngram_replay.py --kinds edit --prompts 8 --new-tokens 128 --k 3 5 8 --verify-cost 2.0

Greedy speculative decoding emits exactly the target's greedy tokens whatever the drafts, so the
drafts a lookup rule would have proposed at each step, and how many of them the target accepts,
follow from the greedy reply alone: this script generates SmolLM2-135M-Instruct's greedy replies
to the held-out prompts of ``scripts/bench_real.py`` once (``--replies`` caches them), then walks
each reply as the engine's step would (the first token from the prefill; each step proposes with
:func:`mtp_jax.drafts.ngram.draft.lookup`, accepts the drafts that match the reply, emits one more) for
every K and every suffix range ``--ngram`` MIN..MAX. It prints the acceptance length, how the
steps split (no match: a plain step; a match: a verifying step; every draft accepted) and, given
what a verifying step costs against a plain one on some machine (``--verify-cost``, e.g. from
``scripts/bench_step.py --draft ngram``), the decoding speed-up that implies. Rules are compared in
seconds here instead of in noisy end-to-end runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))


def greedy_replies(kinds: tuple[str, ...], prompts: int, new_tokens: int, path: str | None) -> list[dict]:
    """[{"prompt": ids, "reply": ids}]: SmolLM2's greedy replies (``new_tokens`` each, past any end
    of turn, as bench_real generates them), read from ``path`` when it holds these settings."""
    settings = {"kinds": list(kinds), "prompts": prompts, "new_tokens": new_tokens}
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
        if cached.get("settings") == settings:
            return cached["replies"]
    import bench_real

    import mtp_jax
    from mtp_jax.embedded import resolve_model_path
    from mtp_jax.text import TextCodec

    codec = TextCodec.for_path(resolve_model_path("smollm2-135m-instruct"))
    by_kind = bench_real.prompt_ids(codec, prompts, kinds)
    ids = [p for kind in kinds for p in by_kind[kind]]
    model = mtp_jax.load("smollm2-135m-instruct", "float32")
    print(f"generating {len(ids)} greedy replies of {new_tokens} tokens ...", file=sys.stderr, flush=True)
    result = model.generate(ids, max_new_tokens=new_tokens, ignore_eos=True, max_batch=8, temperature=0.0)
    replies = [{"prompt": p, "reply": r} for p, r in zip(ids, result.tokens, strict=True)]
    if path:
        from mtp_jax.bench import write_json

        write_json(path, {"settings": settings, "replies": replies})
    return replies


def replay(replies: list[dict], k: int, min_n: int, max_n: int) -> dict:
    """Walk every reply with the lookup of K drafts over suffixes min_n..max_n."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mtp_jax.drafts.ngram.draft import lookup

    propose = jax.jit(functools.partial(lookup, k=k, max_n=max_n, min_n=min_n, none=-1))
    # one history width for every reply: compiled once (the lookup reads only the first n tokens)
    width = max(len(item["prompt"]) + len(item["reply"]) for item in replies) + k
    plain = verifying = all_accepted = tokens = 0
    for item in replies:
        prompt, reply = item["prompt"], item["reply"]
        history = np.zeros((1, width), np.int32)
        history[0, : len(prompt)] = prompt
        history[0, len(prompt)] = reply[0]  # the prefill's token
        length, i = len(prompt) + 1, 1
        while i < len(reply):
            drafts = np.asarray(propose(jnp.asarray(history), jnp.asarray([length], jnp.int32)))[0]
            accepted = 0
            if drafts[0] >= 0:
                verifying += 1
                while accepted < k and i + accepted < len(reply) and drafts[accepted] == reply[i + accepted]:
                    accepted += 1
                all_accepted += accepted == k
            else:
                plain += 1
            emit = min(accepted + 1, len(reply) - i)
            history[0, length : length + emit] = reply[i : i + emit]
            length, i, tokens = length + emit, i + emit, tokens + emit
    return {
        "k": k,
        "min_n": min_n,
        "max_n": max_n,
        "tokens": tokens,
        "steps": plain + verifying,
        "acceptance_length": tokens / (plain + verifying),
        "no_match_steps": plain,
        "verifying_steps": verifying,
        "all_accepted_steps": all_accepted,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kinds", nargs="+", default=["edit"], choices=["chat", "code", "edit"])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[3, 5, 8])
    parser.add_argument(
        "--ngram", nargs="+", default=["3..4"], help="suffix ranges MIN..MAX (the draft's: 3..4)"
    )
    parser.add_argument(
        "--verify-cost", type=float, default=1.0, help="a verifying step's time over a plain step's"
    )
    parser.add_argument("--replies", help="cache the greedy replies in this JSON file")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    ranges = []
    for spec in args.ngram:
        lo, sep, hi = spec.partition("..")
        if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
            parser.error(f"--ngram {spec!r}: give MIN..MAX with 1 <= MIN <= MAX, e.g. 3..4")
        ranges.append((int(lo), int(hi)))
    if min(args.k) < 1 or args.prompts < 1 or args.new_tokens < 2 or args.verify_cost <= 0:
        parser.error("--k, --prompts must be >= 1, --new-tokens >= 2, --verify-cost > 0")

    replies = greedy_replies(tuple(args.kinds), args.prompts, args.new_tokens, args.replies)
    rows = []
    print("| K | suffixes | acceptance length | no-match steps | verifying steps | all accepted | "
          f"decoding speed-up at {args.verify_cost:g}x |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for lo, hi in ranges:
        for k in args.k:
            row = replay(replies, k, lo, hi)
            cost = row["no_match_steps"] + args.verify_cost * row["verifying_steps"]
            row["speedup"] = row["tokens"] / cost  # a plain step per token, against these steps
            rows.append(row)
            print(
                f"| {k} | {lo}..{hi} | {row['acceptance_length']:.2f} | {row['no_match_steps']} | "
                f"{row['verifying_steps']} | {row['all_accepted_steps']} | {row['speedup']:.2f}x |",
                flush=True,
            )
    if args.json:
        from mtp_jax.bench import machine_info, write_json

        write_json(
            args.json,
            {"command": " ".join(["python", "scripts/ngram_replay.py", *sys.argv[1:]]), **machine_info(),
             "verify_cost": args.verify_cost, "rows": rows},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
