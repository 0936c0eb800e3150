"""``mtp-jax bench-acceptance``: drafts measured on the field's prompt sets, as the papers report them.

    mtp-jax bench-acceptance --model smollm2-135m-instruct \\
        --draft-model checkpoints/smollm2-135m-instruct-eagle3 checkpoints/smollm2-135m-instruct-dflash \\
        --json out.json --markdown out.md --plot out.png
    mtp-jax bench-acceptance --model M --draft ngram --sets my-prompts.jsonl --subset 0   # a whole file
    mtp-jax bench-acceptance --server http://localhost:8000 --sets mt-bench   # a running deployment

Prompt sets: MT-Bench, HumanEval, MBPP and GSM8K ship with the package (:mod:`mtp_jax.evalsets`);
any file of ``{"turns": [...]}`` lines may be given instead. The first turn of each prompt is
rendered with the model's chat template (a model without one gets the plain text). A fixed subset
of ``--subset`` prompts per set is drawn with ``--seed`` (0: the whole set); the defaults (16
prompts of each set, 256 new tokens) make a run of two drafts fit in about an hour on a 2-core CPU
for SmolLM2-135M.

For every draft (each ``--draft-model`` directory, each ``--draft`` name), K in ``--k`` and
temperature in ``--temperature``:

- **accepted length per step** (tokens emitted per verification step, the bonus token included,
  as EAGLE-3, DFlash and DSpark count it: plain decoding is 1.0) over the subset, decoded
  ``--acceptance-batch`` rows at a time; the **conditional acceptance per draft position** (the
  share of steps that accepted position j among those that accepted position j - 1);
- **tokens per second** against plain decoding at each ``--batch`` (batch 1: the first
  ``--timing-prompts`` prompts one after another; batch b: the subset b rows at a time), each timed
  run after an untimed one of the same shapes, so no compilation is timed.

Drafts are drawn from the draft's distribution (``draft_sampling="sampled"``, accepted with
min(1, p/q)) at temperatures above 0, as the papers do, and as its argmax at 0
(``--draft-sampling`` overrides). Acceptance is exact either way, so these numbers describe the
target's own distribution. Output: JSON rows, Markdown tables in the papers' layout (draft by
set, macro average) and a chart (PNG, needs matplotlib: ``pip install 'mtp-jax[plot]'``).

``--server URL`` measures a running ``mtp-jax serve`` (or any server with OpenAI routes and vLLM's
``spec_decode`` counters in ``/metrics``) instead: the subset's first turns sent as chat
completions, one at a time and ``--batch`` at once; the accepted length comes from the change in
the server's counters (its own draft and K), tokens per second from the replies' usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from mtp_jax.evalsets import read as read_set

DEFAULT_SETS = ("mt-bench", "humaneval", "mbpp", "gsm8k")
TITLES = {"mt-bench": "MT-Bench", "humaneval": "HumanEval", "mbpp": "MBPP", "gsm8k": "GSM8K"}


@dataclasses.dataclass(frozen=True)
class Drafter:
    """One speculation setting to measure: a draft method (None: plain decoding) of a model
    (``model_index`` into the loaded models: a separately stored draft comes with its own)."""

    label: str
    draft: str | None
    k: int
    model_index: int = 0
    tree: dict | None = None
    """A ``speculative_tree`` setting to verify instead of a chain of ``k`` (a chained draft)."""


def subset(prompts: Sequence[Sequence[str]], n: int, seed: int) -> list[int]:
    """The indices of ``n`` prompts drawn without replacement with ``seed`` (sorted; all for n = 0
    or n >= the set's size): the same subset on every machine."""
    if n <= 0 or n >= len(prompts):
        return list(range(len(prompts)))
    return sorted(int(i) for i in np.random.default_rng(seed).choice(len(prompts), size=n, replace=False))


def first_turns(name: str, n: int, seed: int) -> tuple[list[int], list[str]]:
    """(the chosen prompts' indices in the set, their first user turns)."""
    turns = read_set(name)
    chosen = subset(turns, n, seed)
    return chosen, [turns[i][0] for i in chosen]


def render(model: Any, text: str) -> list[int]:
    """A first turn as token ids: through the chat template when the model has one."""
    if model.text.chat_template is not None:
        return model.text.encode_chat([{"role": "user", "content": text}])
    return model.text.encode(text)


def accepted(request_stats: Sequence[dict]) -> dict:
    """Accepted length and per-position acceptance summed over requests (steps, not requests, are
    the unit: a long reply weighs what its steps weigh)."""
    steps = sum(r["steps"] for r in request_stats)
    emitted = sum(r["acceptance_length"] * r["steps"] for r in request_stats)
    width = max((len(r["num_accepted_tokens_per_pos"]) for r in request_stats), default=0)
    per_pos = np.zeros(width)
    for r in request_stats:
        per_pos[: len(r["num_accepted_tokens_per_pos"])] += r["num_accepted_tokens_per_pos"]
    before = np.concatenate([[steps], per_pos[:-1]]) if width else np.zeros(0)
    conditional = [float(a / b) if b else None for a, b in zip(per_pos, before, strict=True)]
    return {
        "steps": int(steps),
        "accepted_length": float(emitted / steps) if steps else None,
        "acceptance_per_position": [float(x / steps) for x in per_pos] if steps else [],
        "conditional_acceptance_per_position": conditional,
    }


def _generate(model: Any, drafter: Drafter, prompts: list[list[int]], args, temperature: float, batch: int):
    sampling = args.draft_sampling or ("sampled" if temperature > 0 else "argmax")
    kw: dict[str, Any] = {}
    if drafter.tree is not None:  # a dynamic tree's candidates are the draft's likeliest (exact)
        sampling = "argmax" if drafter.tree.get("dynamic") else sampling
        kw = {"draft": drafter.draft, "speculative_tree": drafter.tree, "draft_sampling": sampling}
    elif drafter.draft is not None:
        kw = {"draft": drafter.draft, "num_speculative_tokens": drafter.k, "draft_sampling": sampling}
    return model.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        seed=[args.seed + i for i in range(len(prompts))],
        max_batch=batch,
        **kw,
    )


def measure(models: list[Any], drafters: list[Drafter], args, progress=print, on_row=None) -> list[dict]:
    """Every (set, temperature, drafter) row: acceptance over the subset, speed at each batch;
    ``on_row(rows)`` after each (a long run's partial results written as it goes)."""
    rows = []
    for name in args.sets:
        indices, texts = first_turns(name, args.subset, args.seed)
        for temperature in args.temperature:
            plain_speed: dict[int, float] = {}
            for drafter in drafters:
                model = models[drafter.model_index]
                prompts = [render(model, t) for t in texts]
                row = {
                    "set": name,
                    "prompts": len(prompts),
                    "prompt_indices": indices,
                    "draft": drafter.label,
                    "k": drafter.k,
                    "temperature": temperature,
                    "max_new_tokens": args.max_new_tokens,
                }
                if drafter.draft is not None:
                    out = _generate(model, drafter, prompts, args, temperature, args.acceptance_batch)
                    row.update(accepted(out.request_stats))
                    row["new_tokens"] = out.stats["new_tokens"]
                else:
                    row.update(accepted_length=1.0, acceptance_per_position=[], steps=None)
                for batch in args.batch:
                    timed = prompts[: args.timing_prompts] if batch == 1 else prompts
                    _generate(model, drafter, timed, args, temperature, batch)  # compiles these shapes
                    t0 = time.perf_counter()
                    out = _generate(model, drafter, timed, args, temperature, batch)
                    speed = out.stats["new_tokens"] / (time.perf_counter() - t0)
                    row[f"tokens_per_second_b{batch}"] = speed
                    if drafter.draft is None:
                        plain_speed[batch] = speed
                    if batch in plain_speed:
                        row[f"speedup_b{batch}"] = speed / plain_speed[batch]
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                tau = row["accepted_length"]
                speeds = "  ".join(
                    f"b{b} {row[f'tokens_per_second_b{b}']:.1f} tok/s"
                    + (f" ({row[f'speedup_b{b}']:.2f}x)" if f"speedup_b{b}" in row else "")
                    for b in args.batch
                )
                progress(f"{name:10s} T={temperature:g} {drafter.label:28s} tau {tau:.2f}  {speeds}")
    return rows


def _macro(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    """The papers' layout: one table per temperature, drafts by set (accepted length per step,
    macro average), then the speed-ups and the conditional acceptance by position."""
    sets = list(dict.fromkeys(r["set"] for r in rows))
    out = []
    for temperature in dict.fromkeys(r["temperature"] for r in rows):
        at = [r for r in rows if r["temperature"] == temperature]
        labels = list(dict.fromkeys(f"{r['draft']}" for r in at))
        head = "| draft | " + " | ".join(TITLES.get(s, s) for s in sets) + " | mean |"
        rule = "|---" * (len(sets) + 2) + "|"
        out += [f"### Accepted length per step, temperature {temperature:g}", "", head, rule]
        for label in labels:
            taus = [
                next((r["accepted_length"] for r in at if r["set"] == s and r["draft"] == label), None)
                for s in sets
            ]
            out.append(f"| {label} | " + " | ".join(_fmt(t) for t in taus) + f" | {_fmt(_macro(taus))} |")
        batches = sorted({int(k[len("speedup_b") :]) for r in at for k in r if k.startswith("speedup_b")})
        for b in batches:
            out += [
                "",
                f"Speed-up over plain decoding at batch {b} (tokens per second ratio):",
                "",
                head,
                rule,
            ]
            for label in labels:
                ups = [
                    next((r.get(f"speedup_b{b}") for r in at if r["set"] == s and r["draft"] == label), None)
                    for s in sets
                ]
                out.append(f"| {label} | " + " | ".join(_fmt(u) for u in ups) + f" | {_fmt(_macro(ups))} |")
        drafted = [r for r in at if r.get("conditional_acceptance_per_position")]
        if drafted:
            width = max(len(r["conditional_acceptance_per_position"]) for r in drafted)
            out += ["", "Conditional acceptance by draft position (mean over the sets):", ""]
            out.append("| draft | " + " | ".join(str(j + 1) for j in range(width)) + " |")
            out.append("|---" * (width + 1) + "|")
            for label in labels:
                mine = [r["conditional_acceptance_per_position"] for r in drafted if r["draft"] == label]
                if mine:
                    cols = [_macro([m[j] if j < len(m) else None for m in mine]) for j in range(width)]
                    out.append(f"| {label} | " + " | ".join(_fmt(c) for c in cols) + " |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    """Accepted length per set and draft, one panel per temperature (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: pip install 'mtp-jax[plot]' ({e})") from None
    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    sets = list(dict.fromkeys(r["set"] for r in rows))
    labels = [
        x
        for x in dict.fromkeys(r["draft"] for r in rows)
        if any(r["draft"] == x and r.get("steps") for r in rows)
    ]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    width = 0.8 / max(len(labels), 1)
    for ax, temperature in zip(axes[0], temps, strict=True):
        for i, label in enumerate(labels):
            taus = [
                next(
                    (
                        r["accepted_length"]
                        for r in rows
                        if (r["set"], r["draft"], r["temperature"]) == (s, label, temperature)
                    ),
                    0,
                )
                or 0
                for s in sets
            ]
            ax.bar(np.arange(len(sets)) + i * width, taus, width, label=label)
        ax.set_xticks(np.arange(len(sets)) + width * (len(labels) - 1) / 2, [TITLES.get(s, s) for s in sets])
        ax.set_ylabel("accepted tokens per step")
        ax.set_title(f"temperature {temperature:g}")
        ax.axhline(1.0, color="#888888", linewidth=0.8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


# -- a running server ------------------------------------------------------------------------------


def _metrics(url: str) -> dict[str, float]:
    """The server's spec-decode counters (vLLM's names) from its Prometheus text."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "{" not in line.split()[0]:
            name, value = line.split()[:2]
            found[name] = found.get(name, 0.0) + float(value)
    return found


def _chat(
    url: str, model: str | None, text: str, temperature: float, max_tokens: int, seed: int, key: str | None
):
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
    }
    if model:
        body["model"] = model
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=3600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def measure_server(args, progress=print) -> list[dict]:
    """The subset sent to ``args.server``: accepted length from its counters, speed from usage."""
    url = args.server.rstrip("/")
    rows = []
    for name in args.sets:
        indices, texts = first_turns(name, args.subset, args.seed)
        for temperature in args.temperature:
            row = {
                "set": name,
                "prompts": len(texts),
                "prompt_indices": indices,
                "draft": "server",
                "k": None,
                "temperature": temperature,
                "max_new_tokens": args.max_new_tokens,
            }
            for batch in args.batch:
                chosen = texts[: args.timing_prompts] if batch == 1 else texts
                before = _metrics(url)
                tokens: list[int] = []
                lock = threading.Lock()

                def worker(
                    part: list[tuple[int, str]], tokens=tokens, lock=lock, temperature=temperature
                ) -> None:
                    for i, text in part:
                        n = _chat(
                            url,
                            args.server_model,
                            text,
                            temperature,
                            args.max_new_tokens,
                            args.seed + i,
                            args.api_key,
                        )
                        with lock:
                            tokens.append(n)

                parts = [list(enumerate(chosen))[j::batch] for j in range(batch)]
                t0 = time.perf_counter()
                threads = [threading.Thread(target=worker, args=(p,)) for p in parts if p]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                seconds = time.perf_counter() - t0
                after = _metrics(url)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                steps = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
                acc = delta.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
                row[f"accepted_length_b{batch}"] = 1.0 + acc / steps if steps else 1.0
                row[f"tokens_per_second_b{batch}"] = sum(tokens) / seconds
            row["accepted_length"] = row[f"accepted_length_b{args.batch[-1]}"]
            rows.append(row)
            progress(
                f"{name:10s} T={temperature:g} server tau {row['accepted_length']:.2f}  "
                + "  ".join(f"b{b} {row[f'tokens_per_second_b{b}']:.1f} tok/s" for b in args.batch)
            )
    return rows


# -- the command -----------------------------------------------------------------------------------


def build_parser(prog: str = "mtp-jax bench-acceptance") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="the target (a directory, GGUF file or packaged name)")
    p.add_argument("--draft-model", nargs="*", default=[], help="separately stored drafts' directories")
    p.add_argument("--draft", nargs="*", default=[], help="drafts by name (e.g. ngram, mtp)")
    p.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), help="set names or prompt files")
    p.add_argument("--subset", type=int, default=16, help="prompts per set (0: every prompt)")
    p.add_argument("--seed", type=int, default=0, help="the subset's and the sampling's seed")
    p.add_argument("--k", type=int, nargs="*", default=[7], help="drafts per step (chains; none: trees only)")
    p.add_argument(
        "--tree",
        nargs="*",
        default=[],
        metavar="DEPTH,TOPK[,NODES][,dynamic]",
        help="token trees to measure for each chained draft besides its chains (',dynamic': EAGLE-2's)",
    )
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="batch sizes timed (none: no timing)")
    p.add_argument("--timing-prompts", type=int, default=2, help="prompts timed one at a time at batch 1")
    p.add_argument("--acceptance-batch", type=int, default=8, help="rows at a time for the acceptance pass")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--draft-sampling",
        choices=["argmax", "sampled"],
        default=None,
        help="default: sampled above temperature 0, argmax at 0",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--server", default=None, help="measure a running server at this URL instead")
    p.add_argument("--server-model", default=None, help="the model name to send to --server")
    p.add_argument("--api-key", default=os.environ.get("MTP_JAX_API_KEY"))
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--plot", default=None, help="draw the accepted lengths here (PNG)")
    return p


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None, prog: str = "mtp-jax bench-acceptance") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for flag in ("subset", "max_new_tokens", "timing_prompts", "acceptance_batch"):
        if getattr(args, flag) < (0 if flag == "subset" else 1):
            parser.error(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'subset' else 1}")
    if min(args.k, default=1) < 1 or min(args.batch, default=1) < 1 or min(args.temperature) < 0:
        parser.error("--k and --batch must be >= 1, --temperature >= 0")
    from mtp_jax.tree import tree_setting

    trees = []
    for text in args.tree:
        try:
            trees.append((text, tree_setting(text)))
        except ValueError as e:
            parser.error(f"--tree: {e}")
    if not args.k and not trees:
        parser.error("give --k values, --tree shapes or both")
    for name in args.sets:
        read_set(name)  # a bad file is refused before anything is loaded
    t0 = time.perf_counter()
    command = "mtp-jax bench-acceptance " + " ".join(sys.argv[2:] if argv is None else argv)

    def report(rows: list[dict], partial: bool = False) -> dict:
        done = {"command": command, "seconds": time.perf_counter() - t0, "rows": rows}
        return done | {"partial": True} if partial else done

    if args.server and trees:
        parser.error("--tree measures drafts loaded here; a --server speculates as it was started")
    if args.server:
        rows = measure_server(args, progress=lambda s: print(s, file=sys.stderr, flush=True))
    else:
        import mtp_jax
        from mtp_jax.embedded import default_model_dir

        path = args.model or default_model_dir()
        if path is None:
            parser.error("no --model given and no embedded default model found")
        models = [mtp_jax.load(path, args.dtype)]
        drafters = [Drafter("plain", None, 0)]
        for name in args.draft:
            drafters += [Drafter(f"{name} K={k}", name, k) for k in args.k]
            drafters += [Drafter(f"{name} tree {text}", name, 0, 0, tree) for text, tree in trees]
        for directory in args.draft_model:
            models.append(models[0].with_draft(directory))
            kind = models[-1].default_draft
            label = os.path.basename(os.path.normpath(directory))
            drafters += [Drafter(f"{label} K={k}", kind, k, len(models) - 1) for k in args.k]
            drafters += [
                Drafter(f"{label} tree {text}", kind, 0, len(models) - 1, tree) for text, tree in trees
            ]
        if len(drafters) == 1:
            parser.error("give drafts to measure: --draft-model DIR ... and/or --draft NAME ...")
        rows = measure(
            models,
            drafters,
            args,
            progress=lambda s: print(s, file=sys.stderr, flush=True),
            on_row=lambda rows: (
                args.json and _write(args.json, json.dumps(report(rows, partial=True), indent=1))
            ),
        )
    out = report(rows)
    table = markdown(rows)
    print(table)
    if args.json:
        _write(args.json, json.dumps(out, indent=1))
    if args.markdown:
        _write(args.markdown, table)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
