"""Suffix decoding against plain decoding and n-gram prompt lookup on the workloads it is for, through
the persistent serving engine (one engine per run, as a server would keep it), at each ``--batch``.

Workloads (the prompts are first turns of the shipped benchmark sets, ``mtp_jax/evalsets``, drawn
with ``--seed``):

- ``rollout``: ``--prompts`` prompts (spread over MT-Bench, HumanEval, MBPP and GSM8K), each sampled
  ``--samples`` times at ``--temperature`` (0.7) with its own seed, submitted in order (all of one
  prompt's samples, then the next's), as an RL rollout or best-of-n sampling sends them;
- ``code-edit``: ``--conversations`` code conversations (HumanEval and MBPP) of ``--turns`` turns,
  greedy: after the first answer each turn asks for an edit of the whole code ("rename ...", "add
  type hints ..."), and its prompt is the conversation so far: the answer repeats most of the last;
- ``chat``: ``--chat-prompts`` MT-Bench first turns, greedy: free text, where drafting from
  repetition seldom pays (the goal there is not to lose);
- ``mix``: the rollout, then the chat prompts, in one engine run: where hybrid drafting
  (``--draft-model DIR``: the neural draft alone, and ``suffix_<neural>``) must match the better of
  its parts.

Each (workload, batch, method) runs on a fresh engine after an untimed pass of the same workload
with ``--warm-tokens`` new tokens on another engine of the same settings (which compiles the
programs the timed run needs; the index it learned is thrown away with it). Reported: wall time
from the first submission to the last token, tokens/s, the ratio to plain decoding, the engine's
accepted length, and whether every output equals plain decoding's (seeded sampling draws each
position's token from the same key, so the texts must be identical; the run fails otherwise).

    python scripts/bench_suffix.py --model smollm2-135m-instruct --json benchmarks/suffix/smollm2.json
    python scripts/bench_suffix.py --model smollm2-135m-instruct --workload mix \
        --draft-model checkpoints/smollm2-135m-instruct-eagle3 --methods suffix eagle3 suffix_eagle3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import mtp_jax  # noqa: E402
from mtp_jax.acceptance import first_turns, render  # noqa: E402
from mtp_jax.bench import machine_info, model_path, write_json  # noqa: E402
from mtp_jax.embedded import resolve_model_path  # noqa: E402
from mtp_jax.tree import tree_setting  # noqa: E402

EDITS = [
    "Rename the main function to `solve` and reply with the whole code again.",
    "Add type hints to every function and reply with the whole code again.",
    "Add a docstring to every function and reply with the whole code again.",
    "Add a short comment above each loop and reply with the whole code again.",
]
SETS = ("mt-bench", "humaneval", "mbpp", "gsm8k")


def run(model, settings: dict, batch: int, jobs, max_len: int) -> dict:
    """One engine of ``settings`` (draft, K, options) with ``batch`` slots through ``jobs(engine)``
    (which submits and waits, returning the outputs): wall time, tokens, the engine's stats."""
    with mtp_jax.Engine(model, slots=batch, max_len=max_len, **settings) as engine:
        t0 = time.perf_counter()
        outputs = jobs(engine)
        wall = time.perf_counter() - t0
        stats = engine.stats()
    tokens = sum(len(o) for o in outputs)
    return {
        "outputs": outputs,
        "seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall,
        "acceptance_length": stats.get("acceptance_length"),
        "draft_learned": stats.get("draft_learned"),
        "steps_per_width": stats.get("steps_per_width"),
        "drafts_by_source": stats.get("drafts_by_source"),
        "steps": sum((stats.get("steps_per_width") or {}).values()),  # the engine's steps
    }


def by_source(sources: dict | None) -> str:
    """The accepted and drafted counts by source, as a progress line's tail (empty without)."""
    if not sources:
        return ""
    parts = [f"{name} {v['accepted']}/{v['drafts']}" for name, v in sources.items() if name != "none"]
    return ", accepted/drafted by source: " + ", ".join(parts)


def rollout_jobs(prompts: list[list[int]], samples: int, temperature: float, new_tokens: int, then=()):
    """Each prompt ``samples`` times (seeds 1000 i + s), in order; then the ``then`` prompts once
    each, greedy."""

    def jobs(engine) -> list[list[int]]:
        handles = [
            engine.submit(
                p, max_new_tokens=new_tokens, temperature=temperature, seed=1000 * i + s, ignore_eos=True
            )
            for i, p in enumerate(prompts)
            for s in range(samples)
        ]
        handles += [engine.submit(p, max_new_tokens=new_tokens, ignore_eos=True) for p in then]
        return [list(h.result(timeout=3600).tokens) for h in handles]

    return jobs


def conversation(model, chat: list[dict]) -> list[int]:
    """A conversation's prompt: through the chat template, or as plain text without one."""
    if model.text.chat_template is not None:
        return model.text.encode_chat(chat)
    return model.text.encode("".join(f"{m['role']}: {m['content']}\n" for m in chat) + "assistant: ")


def conversation_jobs(model, firsts: list[str], turns: int, new_tokens: int):
    """Each turn of every conversation submitted together; a turn's prompt is the conversation so
    far (prefix caching reads the earlier turns' pages)."""

    def jobs(engine) -> list[list[int]]:
        chats = [[{"role": "user", "content": text}] for text in firsts]
        outputs = []
        for turn in range(turns):
            if turn:
                for chat in chats:
                    chat.append({"role": "user", "content": EDITS[(turn - 1) % len(EDITS)]})
            prompts = [conversation(model, chat) for chat in chats]
            handles = [engine.submit(p, max_new_tokens=new_tokens) for p in prompts]
            replies = [list(h.result(timeout=3600).tokens) for h in handles]
            for chat, reply in zip(chats, replies, strict=True):
                chat.append(
                    {"role": "assistant", "content": model.text.decode(reply, skip_special_tokens=True)}
                )
            outputs += replies
        return outputs

    return jobs


def workloads(model, args) -> dict:
    """name -> (jobs(new_tokens) -> engine job, what it is)."""
    per_set = -(-args.prompts // len(SETS))
    rollout = [render(model, t) for name in SETS for t in first_turns(name, per_set, args.seed)[1]][
        : args.prompts
    ]
    code = [t for name in ("humaneval", "mbpp") for t in first_turns(name, args.conversations, args.seed)[1]]
    code = code[: args.conversations]
    chat = [render(model, t) for t in first_turns("mt-bench", args.chat_prompts, args.seed)[1]]
    return {
        "rollout": (
            lambda n: rollout_jobs(rollout, args.samples, args.temperature, n),
            f"{len(rollout)} prompts x {args.samples} samples at temperature {args.temperature}",
        ),
        "code-edit": (
            lambda n: conversation_jobs(model, code, args.turns, n),
            f"{len(code)} code conversations x {args.turns} turns, greedy",
        ),
        "chat": (
            lambda n: rollout_jobs(chat, 1, 0.0, n),
            f"{len(chat)} MT-Bench first turns, greedy",
        ),
        "mix": (
            lambda n: rollout_jobs(rollout, args.samples, args.temperature, n, then=chat),
            f"the rollout ({len(rollout)} x {args.samples}), then {len(chat)} MT-Bench first turns",
        ),
    }


def methods(args) -> dict:
    out = {"plain": {}, "ngram": {"draft": "ngram", "num_speculative_tokens": args.k}}
    out["suffix"] = {"draft": "suffix", "num_speculative_tokens": args.k}
    if args.draft_model:  # the neural draft alone, and suffix decoding with it as the fallback
        name = args.neural
        out[name] = {"draft": name, "num_speculative_tokens": args.neural_k}
        out[f"suffix_{name}"] = {"draft": f"suffix_{name}", "num_speculative_tokens": args.k}
    if args.widths:  # the same chains with more verification widths compiled into the step
        for name in [m for m in out if m.startswith("suffix")]:
            out[f"{name} widths"] = {**out[name], "draft_options": {"widths": args.widths}}
    if args.tree:
        out["suffix tree"] = {"draft": "suffix", "speculative_tree": tree_setting(args.tree)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint (default: the embedded model); smollm2-135m-instruct")
    parser.add_argument("--workload", nargs="+", default=["rollout", "code-edit", "chat"], help="or mix")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=8, help="drafts per step of n-gram and suffix chains")
    parser.add_argument("--draft-model", help="a neural draft's directory: it and suffix decoding beside it")
    parser.add_argument("--neural", default="eagle3", help="the draft method of --draft-model")
    parser.add_argument("--neural-k", type=int, default=3, help="K of the neural draft alone")
    parser.add_argument("--methods", nargs="+", help="run only these (plain always runs first)")
    parser.add_argument(
        "--tree", help="also suffix decoding with this dynamic tree (DEPTH,TOPK,NODES,dynamic)"
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        help="also each suffix method with these verification widths (the draft option widths)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="rollout prompts (spread over the four sets)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--chat-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warm-tokens", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    path = model_path(resolve_model_path(args.model) if args.model else None)
    model = mtp_jax.load(path, "float32", draft_model=args.draft_model)
    loads = workloads(model, args)
    unknown = sorted(set(args.workload) - set(loads))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(loads)}")
    rows = []
    for name in args.workload:
        make, what = loads[name]
        for batch in args.batch:
            plain = None
            chosen = methods(args)
            if args.methods:
                chosen = {m: v for m, v in chosen.items() if m == "plain" or m in args.methods}
            for method, settings in chosen.items():
                run(model, settings, batch, make(args.warm_tokens), args.max_len)  # compiles, untimed
                result = run(model, settings, batch, make(args.new_tokens), args.max_len)
                jax.clear_caches()  # a process keeps too many executables otherwise (vm.max_map_count)
                outputs = result.pop("outputs")
                if plain is None:
                    plain = (outputs, result["tokens_per_second"])
                elif outputs != plain[0]:
                    raise SystemExit(
                        f"{name}, batch {batch}: {method}'s outputs differ from plain decoding's"
                    )
                row = {"workload": name, "what": what, "batch": batch, "method": method, **result}
                row["ms_per_step"] = 1e3 * result["seconds"] / max(result.get("steps", 0), 1)
                row["vs_plain"] = result["tokens_per_second"] / plain[1]
                rows.append(row)
                print(
                    f"{name:9s} batch {batch}: {method:11s} {result['tokens_per_second']:7.1f} tok/s "
                    f"({row['vs_plain']:.2f}x plain), accepted length "
                    f"{result['acceptance_length'] or 1.0:.2f}, {result['tokens']} tokens in "
                    f"{result['seconds']:.1f}s, steps by width {result.get('steps_per_width')}"
                    + by_source(result.get("drafts_by_source")),
                    file=sys.stderr,
                    flush=True,
                )
                if args.json:  # written as it goes: a long run keeps what it measured
                    write_json(
                        args.json,
                        {"model": path, "args": vars(args), "machine": machine_info(), "rows": rows},
                    )
    for name in args.workload:
        for batch in args.batch:
            by = {r["method"]: r for r in rows if r["workload"] == name and r["batch"] == batch}
            if "suffix" in by and "ngram" in by:
                ratio = by["suffix"]["tokens_per_second"] / by["ngram"]["tokens_per_second"]
                print(
                    f"{name} batch {batch}: suffix {by['suffix']['vs_plain']:.2f}x plain, {ratio:.2f}x n-gram"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
