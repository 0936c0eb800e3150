"""Serving against offline decoding: the same greedy requests through ``model.generate`` (one call,
continuous batching over ``--slots`` rows), through the persistent :class:`mtp_jax.Engine` (all
submitted at once, streamed with ``astream``), and through ``mtp-jax serve``'s HTTP server on a
loopback port (concurrent streaming clients, httpx), at several request counts.

Every request generates ``--new-tokens`` (EOS ignored). The engine is warmed up first (every
program compiled, as ``mtp-jax serve --warmup first`` does; ``--no-warmup``: one untimed engine run
per request count instead); offline ``generate`` runs once untimed. For each:
throughput (generated tokens / wall time from the first request to the last token),
mean time to first token, mean time per output token after the first (TPOT), and whether every
text equals offline ``generate``'s (checked, not assumed: the run fails otherwise). The server and
its clients share this machine's cores with the engine; that cost is part of what is measured.

    python scripts/bench_serve.py --requests 1 8 32 --new-tokens 64 --json benchmarks/serve.json

Two more workloads (``--workload``), each through the engine with a feature off and on, in one run:

- ``shared-prefix``: ``--requests`` requests (32) that share a ``--system-len``-token system prompt,
  each with its own 32-token question, submitted at once, without and with prefix caching (the
  system prompt seen before, as on a server that has been up a while; an untimed pass of other
  questions compiles the programs), and with prefix caching on a system prompt never seen before
  (the burst prefills it once: the first request, then the others read its pages). TTFT,
  throughput, the prompt tokens prefilled, and whether the texts are equal.
- ``multi-turn``: ``--requests`` conversations (8) of ``--turns`` turns (4) at once, each turn's
  prompt the conversation so far (a ``--system-len``-token opening, then each reply and a 32-token
  message), without and with prefix caching: the later turns' TTFT, and the prompt tokens
  prefilled against those a cache of prompt pages alone (no reply pages) would have prefilled.
- ``logprobs``: the ``--requests`` counts through the engine without and with ``logprobs`` (5
  alternatives per token), alternately, twice each: what asking for log-probabilities costs a
  server's throughput (the step runs its own program for them), and that the texts are equal.
- ``long-prompt``: ``--slots`` - 1 requests decode while a ``--long-len``-token prompt arrives,
  without and with chunked prefill (``--chunk``): the running requests' longest gap between two
  tokens while that prompt is prefilled (a whole prefill stalls them all), their mean time per
  token then, and the long prompt's TTFT.

    python scripts/bench_serve.py --workload shared-prefix --system-len 1024 --json prefix.json
    python scripts/bench_serve.py --workload long-prompt --long-len 2048 --chunk 256
    python scripts/bench_serve.py --workload multi-turn --system-len 256 --turns 4 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_jax  # noqa: E402
from mtp_jax.bench import held_out_prompts, machine_info, model_path, write_json  # noqa: E402


def _summary(starts: list[float], firsts: list[float], ends: list[float], counts: list[int]) -> dict:
    t0 = min(starts)
    total = sum(counts)
    tpot = [(e - f) / (n - 1) for f, e, n in zip(firsts, ends, counts, strict=True) if n > 1]
    return {
        "tokens": total,
        "seconds": max(ends) - t0,
        "tok_s": total / (max(ends) - t0),
        "ttft_ms": 1000 * float(np.mean([f - s for s, f in zip(starts, firsts, strict=True)])),
        "tpot_ms": 1000 * float(np.mean(tpot)) if tpot else None,
    }


def offline(model, prompts: list[list[int]], args, gen: dict) -> tuple[dict, list[str], list[int]]:
    def run():
        return model.generate(
            prompts, max_new_tokens=args.new_tokens, max_batch=args.slots, ignore_eos=True, **gen
        )

    run()  # compiled for this many rows (the engine keeps its programs: it compiled once, before)
    t0 = time.perf_counter()
    out = run()
    t1 = time.perf_counter()
    total = sum(len(t) for t in out.tokens)
    summary = {"tokens": total, "seconds": t1 - t0, "tok_s": total / (t1 - t0)}
    return summary, [model.text.decode(t) for t in out.tokens], [len(t) for t in out.tokens]


def through_engine(engine, prompts: list[list[int]], args, **kw) -> tuple[dict, list[str]]:
    async def one(i: int, handle, t_submit: float, rec: list) -> None:
        first, text = None, ""
        async for _, piece in handle.astream():
            first = first or time.perf_counter()
            text += piece
        rec[i] = (t_submit, first, time.perf_counter(), len(handle.result().tokens), text)

    async def run() -> list:
        rec: list = [None] * len(prompts)
        tasks = []
        for i, p in enumerate(prompts):
            t = time.perf_counter()
            h = engine.submit(p, max_new_tokens=args.new_tokens, ignore_eos=True, detokenize=True, **kw)
            tasks.append(one(i, h, t, rec))
        await asyncio.gather(*tasks)
        return rec

    rec = asyncio.run(run())
    return _summary(*[list(x) for x in list(zip(*rec, strict=True))[:4]]), [r[4] for r in rec]


def through_http(base: str, prompts: list[list[int]], counts: list[int], args) -> tuple[dict, list[str]]:
    import httpx

    async def one(http, i: int, rec: list) -> None:
        body = {"prompt": prompts[i], "max_tokens": args.new_tokens, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        t0, first, text = time.perf_counter(), None, ""
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    piece = json.loads(line[6:])["choices"][0]["text"]
                    if piece:
                        first = first or time.perf_counter()
                        text += piece
        rec[i] = (t0, first, time.perf_counter(), counts[i], text)

    async def run() -> list:
        rec: list = [None] * len(prompts)
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            await asyncio.gather(*(one(http, i, rec) for i in range(len(prompts))))
        return rec

    rec = asyncio.run(run())
    return _summary(*[list(x) for x in list(zip(*rec, strict=True))[:4]]), [r[4] for r in rec]


def _timed(engine, prompt: list[int], new_tokens: int, stamps: list, **kw):
    """Submit ``prompt``; a thread appends (time, count) for each token it emits to ``stamps``."""
    h = engine.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True, **kw)

    def read() -> None:
        for n, _ in enumerate(h, 1):
            stamps.append((time.perf_counter(), n))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return h, thread


def shared_prefix(model, args, gen: dict) -> tuple[list[dict], bool]:
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = rng.integers(2, vocab, args.system_len).tolist()
    questions = [rng.integers(2, vocab, 32).tolist() for _ in range(2 * args.requests[0])]
    cold = rng.integers(2, vocab, args.system_len).tolist()  # a system prompt the engine never saw
    n = args.requests[0]
    rows, texts = [], {}
    for caching, label in ((False, "off"), (True, "on"), (True, "on, cold")):
        max_len = args.system_len + 32 + args.new_tokens
        engine = mtp_jax.Engine(
            model, slots=args.slots, max_len=max_len, **gen, max_queue=1024, prefix_caching=caching
        )
        for timed, part in ((False, questions[n:]), (True, questions[:n])):  # untimed: compiles, caches
            stamps: list[list] = [[] for _ in range(n)]
            head = cold if label == "on, cold" and timed else system
            before = engine.stats().get("prefix_cache_hits", 0)
            t0 = time.perf_counter()
            runs = [_timed(engine, head + q, args.new_tokens, stamps[i]) for i, q in enumerate(part)]
            for _, thread in runs:
                thread.join()
        t1 = max(st[-1][0] for st in stamps)
        ttft = [st[0][0] - t0 for st in stamps]
        stats = engine.stats()
        texts[label] = [h.result().tokens for h, _ in runs]
        hits = stats.get("prefix_cache_hits", 0) - before
        row = {
            "prefix_caching": label,
            "requests": n,
            "tok_s": n * args.new_tokens / (t1 - t0),
            "ttft_ms_mean": 1000 * float(np.mean(ttft)),
            "ttft_ms_max": 1000 * float(np.max(ttft)),
            "prompt_tokens_prefilled": sum(len(head) + len(q) for q in part) - hits,
            "prefix_cache_hits": stats.get("prefix_cache_hits", 0),
            "prefix_cache_queries": stats.get("prefix_cache_queries", 0),
        }
        engine.close()
        rows.append(row)
        print(
            f"shared prefix of {args.system_len} tokens, {n} requests, prefix caching {label}: "
            f"{row['tok_s']:.1f} tok/s, TTFT mean {row['ttft_ms_mean']:.0f} ms "
            f"(max {row['ttft_ms_max']:.0f}), {row['prompt_tokens_prefilled']} prompt tokens prefilled",
            flush=True,
        )
    same = texts["off"] == texts["on"]  # the cold arm's prompts differ: compared with itself in-run
    print(f"same tokens with and without prefix caching: {same}", flush=True)
    return rows, same


def _conversations(model, args, seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """``--requests`` conversations: an opening of ``--system-len`` tokens and ``--turns`` messages
    of 32 random tokens each."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    return [
        (
            rng.integers(2, vocab, args.system_len).tolist(),
            [rng.integers(2, vocab, 32).tolist() for _ in range(args.turns)],
        )
        for _ in range(args.requests[0])
    ]


def _converse(engine, conversations, new_tokens: int, page: int) -> dict:
    """Run every conversation at once, each turn's prompt the conversation so far: per turn the
    TTFTs, the prompt tokens, the replies, and the prompt tokens a cache of prompt pages alone would
    have found (the previous turn's prompt, whole pages, followed by at least one more token)."""
    out = {"ttft": [[] for _ in conversations], "prompt": 0, "prompt_only_hits": 0, "tokens": []}
    lock = threading.Lock()

    def talk(i: int, opening: list[int], messages: list[list[int]]) -> None:
        history, replies, earlier = list(opening), [], None
        for message in messages:
            prompt = history + message
            done = engine.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True).result()
            with lock:
                out["ttft"][i].append(done.stats["time_to_first_token_seconds"])
                out["prompt"] += len(prompt)
                if earlier is not None:
                    out["prompt_only_hits"] += (len(earlier) - 1) // page * page
            replies.append(done.tokens)
            earlier, history = prompt, prompt + done.tokens
        with lock:
            out["tokens"].append((i, replies))

    threads = [threading.Thread(target=talk, args=(i, *c)) for i, c in enumerate(conversations)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["seconds"] = time.perf_counter() - t0
    out["tokens"] = [r for _, r in sorted(out["tokens"])]
    return out


def multi_turn(model, args, gen: dict) -> tuple[list[dict], bool]:
    n = args.requests[0]
    max_len = args.system_len + args.turns * (32 + args.new_tokens) + 16
    rows, replies = [], {}
    for caching in (False, True):
        engine = mtp_jax.Engine(
            model, slots=args.slots, max_len=max_len, **gen, max_queue=1024, prefix_caching=caching
        )
        _converse(engine, _conversations(model, args, 1), args.new_tokens, model.page_size)  # compiles
        before = engine.stats().get("prefix_cache_hits", 0)
        run = _converse(engine, _conversations(model, args, 2), args.new_tokens, model.page_size)
        hits = engine.stats().get("prefix_cache_hits", 0) - before
        engine.close()
        replies[caching] = run["tokens"]
        later = [t for ttfts in run["ttft"] for t in ttfts[1:]]
        row = {
            "prefix_caching": caching,
            "conversations": n,
            "turns": args.turns,
            "seconds": run["seconds"],
            "ttft_ms_first_turn": 1000 * float(np.mean([t[0] for t in run["ttft"]])),
            "ttft_ms_later_turns": 1000 * float(np.mean(later)),
            "prompt_tokens": run["prompt"],
            "prompt_tokens_prefilled": run["prompt"] - hits,
            "prompt_tokens_prefilled_prompt_pages_only": run["prompt"] - run["prompt_only_hits"],
        }
        rows.append(row)
        alone = row["prompt_tokens_prefilled_prompt_pages_only"]
        print(
            f"{n} conversations x {args.turns} turns, prefix caching {'on ' if caching else 'off'}: "
            f"{row['seconds']:.1f} s, TTFT first turn {row['ttft_ms_first_turn']:.0f} ms, later turns "
            f"{row['ttft_ms_later_turns']:.0f} ms; prompt tokens prefilled {row['prompt_tokens_prefilled']} "
            f"of {row['prompt_tokens']} (prompt pages alone: {alone})",
            flush=True,
        )
    same = replies[False] == replies[True]
    print(f"same replies with and without prefix caching: {same}", flush=True)
    return rows, same


def long_prompt(model, args, gen: dict) -> tuple[list[dict], bool]:
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    long = rng.integers(2, vocab, args.long_len).tolist()
    short = [rng.integers(2, vocab, 32).tolist() for _ in range(args.slots - 1)]
    decode = 4 * args.new_tokens
    rows, tokens = [], {}
    for chunk in (None, args.chunk):
        max_len = max(args.long_len + 16, 32 + decode)
        engine = mtp_jax.Engine(
            model, slots=args.slots, max_len=max_len, **gen, prefix_caching=False, chunked_prefill_size=chunk
        )
        for _ in range(2):  # the first, untimed, pass compiles every program the timed one runs
            stamps: list[list] = [[] for _ in short]
            runs = [_timed(engine, p, decode, stamps[i]) for i, p in enumerate(short)]
            while min(len(st) for st in stamps) < 8:  # all decoding
                time.sleep(0.001)
            arrived: list = []
            t0 = time.perf_counter()
            big, big_thread = _timed(engine, long, 16, arrived)
            big_thread.join()
            for _, thread in runs:
                thread.join()
        t_first = arrived[0][0]
        gaps, during = [], 0
        for st in stamps:
            times = [t for t, _ in st]
            window = [t for t in times if t0 <= t <= t_first]
            during += len(window)
            edges = [t0, *window, t_first]
            gaps.append(max(b - a for a, b in zip(edges, edges[1:], strict=False)))
        tokens[chunk] = [h.result().tokens for h, _ in runs] + [big.result().tokens]
        row = {
            "chunked_prefill": chunk,
            "long_len": args.long_len,
            "running": len(short),
            "long_ttft_ms": 1000 * (t_first - t0),
            "running_tokens_during_prefill": during,
            "running_max_gap_ms": 1000 * float(max(gaps)),
            "running_ms_per_token_during_prefill": 1000 * (t_first - t0) * len(short) / max(during, 1),
            "prefill_chunks": engine.stats()["prefill_chunks"],
        }
        engine.close()
        rows.append(row)
        print(
            f"a {args.long_len}-token prompt arrives, {len(short)} requests decoding, chunked prefill "
            f"{chunk or 'off'}: long TTFT {row['long_ttft_ms']:.0f} ms; running requests: "
            f"{during} tokens meanwhile, longest gap {row['running_max_gap_ms']:.0f} ms",
            flush=True,
        )
    same = tokens[None] == tokens[args.chunk]
    print(f"same tokens with and without chunked prefill: {same}", flush=True)
    return rows, same


def _report(args, path: str, results: list, **extra) -> None:
    """Write the run's settings, the machine and ``results`` to ``--json`` (if given)."""
    report = {
        "model": os.path.basename(os.path.abspath(path)),
        "k": args.k,
        "slots": args.slots,
        "new_tokens": args.new_tokens,
        **extra,
        **machine_info(),
        "results": results,
    }
    if args.json:
        write_json(args.json, report)


def logprobs_cost(model, args, gen: dict, prompts: list[list[int]]) -> tuple[list[dict], bool]:
    engine = mtp_jax.Engine(
        model, slots=args.slots, max_len=args.max_len, **gen, max_queue=1024, prefix_caching=False
    )
    rows, same = [], True
    for n in args.requests:
        batch = prompts[:n]
        for kw in ({}, {"logprobs": 5}):
            through_engine(engine, batch, args, **kw)  # untimed: compiles what this count runs
        runs: dict[bool, list] = {False: [], True: []}
        texts = {}
        for _ in range(2):
            for asks in (False, True):
                summary, texts[asks] = through_engine(
                    engine, batch, args, **({"logprobs": 5} if asks else {})
                )
                runs[asks].append(summary["tok_s"])
        same &= texts[False] == texts[True]
        without, with_ = float(np.median(runs[False])), float(np.median(runs[True]))
        rows.append({"requests": n, "tok_s_without": without, "tok_s_with_logprobs": with_})
        print(
            f"{n:>4} requests: {without:7.1f} tok/s without log-probabilities, {with_:7.1f} with 5 "
            f"alternatives ({with_ / without:.2f}x)",
            flush=True,
        )
    engine.close()
    print(f"same text with and without log-probabilities: {same}", flush=True)
    return rows, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--drafts", default="none,mtp", help="comma-separated: none and/or the model's drafts")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="instead of Engine.warmup() (every program: minutes at a long --max-len), one untimed "
        "engine run per request count",
    )
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32, help="random prompts (no eval.json) only")
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--workload",
        choices=["requests", "shared-prefix", "multi-turn", "long-prompt", "logprobs"],
        default="requests",
    )
    p.add_argument("--system-len", type=int, default=1024, help="shared-prefix: the shared prompt's tokens")
    p.add_argument("--long-len", type=int, default=2048, help="long-prompt: the long prompt's tokens")
    p.add_argument("--chunk", type=int, default=256, help="long-prompt: the chunked prefill size")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    args = p.parse_args(argv)

    import uvicorn

    from mtp_jax.server import Server

    path = model_path(args.model)
    model = mtp_jax.load(path, dtype=args.dtype)
    args.prompts = max(args.requests)
    prompts, note = held_out_prompts(model, path, args)
    if args.workload != "requests":
        draft = args.drafts.split(",")[-1]
        spec = None if draft == "none" else draft
        gen = {"draft": spec, "num_speculative_tokens": args.k if spec else None}
        if args.workload == "logprobs":
            results, same = logprobs_cost(model, args, gen, prompts)
        else:
            runs = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "long-prompt": long_prompt}
            results, same = runs[args.workload](model, args, gen)
        _report(args, path, results, workload=args.workload, draft=draft, same_tokens=same)
        return 0 if same else 1
    rows, ok = [], True
    for draft in args.drafts.split(","):
        spec = None if draft == "none" else draft
        gen = {"draft": spec, "num_speculative_tokens": args.k if spec else None}
        # the same prompts run twice (engine, then HTTP): no prefix caching, so both prefill them
        engine = mtp_jax.Engine(
            model, slots=args.slots, max_len=args.max_len, **gen, max_queue=1024, prefix_caching=False
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(
            uvicorn.Config(Server(engine, "bench").app(), log_level="warning", timeout_keep_alive=60)
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        t0 = time.perf_counter()
        if not args.no_warmup:
            programs = engine.warmup()  # as `mtp-jax serve --warmup first` does
            took = time.perf_counter() - t0
            print(f"draft {draft}: {programs} programs compiled in {took:.1f}s", flush=True)
        for n in args.requests:
            batch = prompts[:n]
            if args.no_warmup:
                through_engine(engine, batch, args)  # untimed: compiles what this request count runs
            off, want, counts = offline(model, batch, args, gen)
            eng, eng_texts = through_engine(engine, batch, args)
            http, http_texts = through_http(base, batch, counts, args)
            same = eng_texts == want and http_texts == want
            ok &= same
            rows.append({"draft": draft, "requests": n, "offline": off, "engine": eng, "http": http})
            rows[-1]["same_text"] = same
            line = f"{draft:>5} {n:>4} requests: offline {off['tok_s']:7.1f} tok/s"
            for name, r in (("engine", eng), ("http", http)):
                line += (
                    f" | {name} {r['tok_s']:7.1f} ({r['tok_s'] / off['tok_s']:.2f}x, "
                    f"TTFT {r['ttft_ms']:.0f} ms, TPOT {r['tpot_ms'] or 0:.1f} ms)"
                )
            print(f"{line} | same text {same}", flush=True)
        server.should_exit = True
        thread.join(30)
        engine.close()
    _report(args, path, rows, prompts=note)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
