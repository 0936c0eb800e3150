"""Decode throughput, plain and speculative, measured after warm-up in one process.

    mtp-jax bench                                             # the embedded default model
    mtp-jax bench --k 0 1 2 3 4 --batch 1 8 --json out.json --plot out.png
    mtp-jax bench --synthetic oracle-small --k 0 3            # a generated checkpoint
    mtp-jax bench --model T --draft-model D --draft mtp eagle3 # draft methods side by side
    mtp-jax bench --model T --draft-model E3 DF --block-size 4 8 16   # EAGLE-3 and DFlash drafts,
                                                              # DFlash at three block sizes
    python scripts/bench.py ...                               # the same

Prompts: a checkpoint's held-out prompts when it ships them (``eval.json``, written by
``scripts/train_tiny.py``: code from standard-library modules the model never saw), else random
token ids. For every batch size (the number of slots) and K (0 = plain decoding) each configuration
first runs once to compile (same shapes), then ``--repeats`` timed runs over the same prompts,
interleaved across configurations so that machine drift hits all of them alike; the median decode
rate is reported with the acceptance statistics, the speed-up over K = 0 and, for
K > 0, the ratio of the fused step to the host-orchestrated baseline (the same stages as separate
executables with a host round trip in between). Ratios are only meaningful within one run.

Synthetic models: ``small`` (random weights: drafts are almost never accepted) and
``oracle-small`` (same size; its MTP layer is built to predict the target most of the time, so the
machinery can be timed; its acceptance says nothing about real drafts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

SMALL = {
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "num_nextn_predict_layers": 1,
    "eos_token_id": 1,
}


def _add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """The confidence schedule's: its steps/s table written, reused, and the scheduled runs; auto-K."""
    parser.add_argument(
        "--sps-table",
        metavar="FILE",
        help="write the steps/s of the confidence-scheduled step at widths 1..max(--k)+1 per --batch "
        "(a draft with a confidence head: dspark), for generate/serve --schedule confidence --sps-table",
    )
    parser.add_argument(
        "--sps-from",
        metavar="FILE",
        help="with --schedule: the steps/s table an earlier --sps-table run wrote (its batch sizes and "
        "widths), instead of measuring it again",
    )
    parser.add_argument(
        "--schedule",
        action="store_true",
        help="also run each draft with a confidence head (dspark) at every K > 0 under the confidence "
        "schedule (each step's width picked from its confidences and the steps/s table, measured first: "
        "written to --sps-table when given)",
    )
    parser.add_argument(
        "--auto-k",
        metavar="FILE",
        help="also run each draft with this auto-K table (K up to the largest --k) at every batch size",
    )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    src.add_argument("--synthetic", choices=["small", "oracle-small"], help="a generated checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode slots")
    parser.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=None,
        help="drafts per step; 0 = plain (default: 0 1 2 3 4 with a draft, else 0)",
    )
    parser.add_argument("--draft-sampling", default="argmax", choices=["argmax", "sampled"])
    parser.add_argument(
        "--draft",
        nargs="+",
        default=None,
        help="draft methods to compare (default: every one the model has, e.g. mtp eagle3; weightless "
        "ones such as ngram when named)",
    )
    parser.add_argument(
        "--draft-model",
        nargs="+",
        default=[],
        help="separately trained drafts' directories (EAGLE-3, DFlash), each loaded beside the target",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        nargs="+",
        default=None,
        help="DFlash block sizes to run (default: the draft's own); K runs up to block size - 1",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per run (shared by the slots)")
    parser.add_argument("--prompt-len", type=int, default=32, help="random prompts only: tokens each")
    parser.add_argument(
        "--prompt-sets",
        nargs="+",
        metavar="SET",
        help='prompts from these benchmark sets (mt-bench, humaneval, mbpp, gsm8k) or {"turns": [...]} '
        "JSON-lines files: first turns (chat-rendered when the model has a template), --prompts in all, "
        "the sets in turn, drawn with seed 0",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip the host-orchestrated baseline")
    parser.add_argument(
        "--auto-k-table",
        metavar="FILE",
        help="write the best K per batch size and draft (plain decoding included) here, for "
        "generate --auto-k FILE",
    )
    _add_schedule_arguments(parser)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib: pip install '.[plot]')")
    return parser


def held_out_prompts(model, path: str | None, args: argparse.Namespace) -> tuple[list[list[int]], str]:
    """``--prompt-sets``' first turns; else held-out prompts from the checkpoint's eval.json when
    present, else random token ids."""
    if getattr(args, "prompt_sets", None):
        from mtp_jax.acceptance import first_turns, render

        per_set = -(-args.prompts // len(args.prompt_sets))
        texts = [first_turns(name, per_set, 0)[1] for name in args.prompt_sets]
        mixed = [t[i] for i in range(per_set) for t in texts if i < len(t)][: args.prompts]
        if len(mixed) < args.prompts:
            raise SystemExit(
                f"--prompt-sets {args.prompt_sets} hold {len(mixed)} prompts, fewer than --prompts"
            )
        return [render(model, t) for t in mixed], f"{len(mixed)} first turns of {', '.join(args.prompt_sets)}"
    eval_path = None if path is None else os.path.join(path, "eval.json")
    if eval_path and os.path.isfile(eval_path) and model.tokenizer_path is not None:
        with open(eval_path, encoding="utf-8") as f:
            texts = json.load(f).get("prompts") or []
        if texts:
            ids = [model.text.encode(t) for t in texts]
            note = f"{len(texts)} held-out prompts (eval.json)"
            return [ids[i % len(ids)] for i in range(args.prompts)], note
    rng = np.random.default_rng(0)
    ids = rng.integers(2, model.config.vocab_size, (args.prompts, args.prompt_len)).tolist()
    return ids, f"random prompts of {args.prompt_len} tokens"


def model_path(arg: str | None) -> str:
    """The checkpoint directory a benchmark runs on: ``arg``, else the embedded default model."""
    from mtp_jax.embedded import default_model_dir

    path = arg or default_model_dir()
    if path is None:
        raise FileNotFoundError("no --model given and no embedded model found")
    return path


def machine_info() -> dict:
    """What a benchmark report records about where it ran."""
    return {
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
    }


def write_json(path: str, report: dict) -> None:
    """Write ``report`` as JSON to ``path`` through a temporary name: never a half-written file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def measure(prompts, args: argparse.Namespace, batch: int, configs: list[tuple]) -> list[dict]:
    """Decode rates of several (model, generate kwargs) configurations: each compiled by an
    untimed run first, then the timed runs interleaved (config 1, 2, ..., 1, 2, ...) so drift on a
    noisy machine hits all of them alike. Returns, per config, the median decode rate and the last
    run's statistics."""

    def once(model, kwargs: dict) -> dict:
        return model.generate(
            prompts, max_new_tokens=args.new_tokens, ignore_eos=True, max_batch=batch, **kwargs
        ).stats

    for model, kwargs in configs:
        once(model, kwargs)  # compile every shape this configuration uses
    runs: list[list[dict]] = [[] for _ in configs]
    for _ in range(args.repeats):
        for i, (model, kwargs) in enumerate(configs):
            runs[i].append(once(model, kwargs))
    return [
        {"decode_tok_s": statistics.median(r["decode_tokens_per_second"] for r in rs), "stats": rs[-1]}
        for rs in runs
    ]


def run(args: argparse.Namespace) -> dict:
    import mtp_jax
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts import DRAFTS
    from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
    from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors, oracle_draft_tensors

    if min(args.batch) < 1 or min(args.k or [0]) < 0 or args.prompts < 1 or args.repeats < 1:
        raise ValueError("--batch, --prompts and --repeats must be >= 1 and --k >= 0")
    if getattr(args, "sps_from", None) and not os.path.isfile(args.sps_from):
        raise ValueError(f"--sps-from {args.sps_from}: no such file (write one with --sps-table)")
    if args.block_size is not None and min(args.block_size) < 2:
        raise ValueError("--block-size must be >= 2 (an anchor and one draft)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            path = os.path.join(tmp, args.synthetic)
            cfg = DeepseekV3Config.from_dict(SMALL)
            oracle = args.synthetic == "oracle-small"
            write_hub_checkpoint(path, SMALL, oracle_draft_tensors(cfg, 0.01) if oracle else hub_tensors(cfg))
            name = f"synthetic:{args.synthetic}"
        else:
            path = model_path(args.model)
            name = os.path.basename(os.path.abspath(path))
        model, owners = _load_drafted(mtp_jax, path, args)
        drafts = list(owners) if args.draft is None else args.draft
        owners.update({d: model for d in drafts if d in DRAFTS and not DRAFTS[d].weights})  # any model
        missing = [d for d in drafts if d not in owners]
        if missing:
            raise ValueError(f"{name} cannot draft with {missing}; it has {list(owners) or 'no draft'}")
        if args.k is None:
            args.k = [0, 1, 2, 3, 4] if drafts else [0]
        if max(args.k) and not drafts:
            raise ValueError(f"{name} has no draft to speculate with: only --k 0 (plain decoding) can run")
        prompts, prompt_note = held_out_prompts(model, None if args.synthetic else path, args)
        triples, trained_blocks = _bench_triples(drafts, owners, args)
        if args.schedule and args.sps_from:  # speeds measured by an earlier run
            args.sps_table = args.sps_from
        elif args.schedule:  # the speeds the schedule weighs, measured before any configuration runs
            args.sps_table = args.sps_table or os.path.join(tmp, "sps.json")
            write_sps_table(args, drafts, owners)
            jax.clear_caches()
        rows = []
        for batch in args.batch:
            rows += _bench_batch(batch, triples, trained_blocks, drafts, owners, model, prompts, args)
            # one batch size's programs are done with: a process that kept every one of a long run's
            # executables runs out of memory maps (LLVM: "Unable to allocate section memory")
            jax.clear_caches()
        if args.sps_table and not args.schedule:
            write_sps_table(args, drafts, owners)
    return {
        "model": name,
        "dtype": args.dtype,
        "temperature": args.temperature,
        "draft_sampling": args.draft_sampling,
        "prompts": prompt_note,
        "prompts_per_run": args.prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **machine_info(),
        "results": rows,
    }


def write_sps_table(args: argparse.Namespace, drafts: list[str], owners: dict) -> None:
    """``--sps-table``: the first draft with a confidence head, its scheduling step timed at each
    width 1..max(--k)+1 for each --batch (:func:`mtp_jax.timing.sps_table`), written to the file."""
    import jax.numpy as jnp

    from mtp_jax.timing import sps_table

    confident = [d for d in drafts if _confident(owners[d], d)]
    if not confident or max(args.k) < 1:
        raise ValueError("--sps-table needs a draft with a confidence head (dspark) and a --k of at least 1")
    model = owners[confident[0]]
    table = sps_table(
        model.params,
        model.config,
        k=max(args.k),
        batches=args.batch,
        context=args.prompt_len + args.new_tokens // 2,
        page_size=model.page_size,
        dtype=jnp.dtype(model.dtype),
        iters=4,
        draft=confident[0],
        draft_cfg=model.draft_config,
        progress=lambda line: print(line, file=sys.stderr),
    )
    table.save(args.sps_table)
    print(f"SPS table ({confident[0]}, widths 1..{max(args.k) + 1}) -> {args.sps_table}", file=sys.stderr)


def _bench_triples(drafts: list[str], owners: dict, args: argparse.Namespace) -> tuple[list[tuple], dict]:
    """The (draft, K, block) configurations timed: plain decoding once, every draft at every K > 0
    (a draft that proposes blocks, as DFlash, at every block size that holds K drafts), K "auto"
    with --auto-k; and each block draft's trained block size."""
    from mtp_jax.drafts import DRAFTS

    triples = [(None, 0, None)] * (0 in args.k)
    trained_blocks = {}  # draft -> the block size it was trained on (block drafts only)
    for d in drafts:
        blocks = [None]
        if DRAFTS[d].block_size is not None:
            trained = trained_blocks[d] = DRAFTS[d].block_size(owners[d].draft_config)
            blocks = args.block_size or [trained]
            if max(blocks) > trained:
                raise ValueError(
                    f"--block-size {max(blocks)}: the {DRAFTS[d].title} draft was trained on blocks "
                    f"of {trained}"
                )
        for b in blocks:  # the drafts a block proposes: its draft's default K at that block
            most = (
                None if b is None else DRAFTS[d].configure(owners[d].draft_config, None, {"block_size": b})[1]
            )
            triples += [(d, k, b) for k in args.k if k and (most is None or k <= most)]
    if args.auto_k:  # K "auto": the table picks it, up to the largest K asked for
        triples += [(d, "auto", None) for d in drafts]
    return triples, trained_blocks


def _bench_batch(
    batch: int,
    triples: list[tuple],
    trained_blocks: dict,
    drafts: list[str],
    owners: dict,
    model: Any,
    prompts: Any,
    args: argparse.Namespace,
) -> list[dict]:
    """One batch size's rows: every configuration measured interleaved, each against plain."""
    rows = []
    print(f"batch {batch}: K = {args.k}, drafts {drafts} ...", file=sys.stderr, flush=True)
    configs, keys = [], []
    for draft, k, block in triples:
        spec = {"temperature": args.temperature, "draft_sampling": args.draft_sampling}
        if k == "auto":
            spec.update(draft=draft, num_speculative_tokens=max(args.k), auto_k=args.auto_k)
        elif k:
            spec.update(draft=draft, num_speculative_tokens=k)
        if block is not None and args.block_size:
            spec["draft_block_size"] = block
        configs.append((owners.get(draft, model), spec))
        keys.append((draft, k, block, "fused"))
        if k and k != "auto" and not args.no_baseline:
            configs.append((owners[draft], {**spec, "fused": False}))
            keys.append((draft, k, block, "host"))
        if k and k != "auto" and args.schedule and _confident(owners[draft], draft):
            configs.append((owners[draft], {**spec, "schedule": "confidence", "sps_table": args.sps_table}))
            keys.append((draft, k, block, "confidence"))
    measured = dict(zip(keys, measure(prompts, args, batch, configs), strict=True))
    plain = (None, 0, None, "fused")
    base = measured[plain]["decode_tok_s"] if plain in measured else None
    for draft, k, block, mode in keys:
        if mode == "host":
            continue
        fused = measured[(draft, k, block, mode)]
        row = {
            "batch": batch,
            "draft": draft,
            "k": fused["stats"]["num_speculative_tokens"] if k == "auto" else k,
            "acceptance_length": fused["stats"]["acceptance_length"],
            "acceptance_by_position": fused["stats"]["acceptance_rate_per_position"],
            "decode_tok_s": fused["decode_tok_s"],
            "speedup_vs_plain": fused["decode_tok_s"] / base if base else None,
        }
        if block is not None:
            row["block_size"] = block
            row["trained_block_size"] = trained_blocks[draft]
        if k == "auto":
            row["auto_k"] = True
        if mode == "confidence":  # the widths the schedule chose: row-steps by drafts verified
            row["schedule"] = "confidence"
            # the table said no width could beat plain decoding at this batch: it decoded plainly
            row["scheduled_plain"] = fused["stats"]["num_speculative_tokens"] == 0
            row["steps_per_verified_drafts"] = fused["stats"]["steps_per_verified_drafts"]
            row["expected_accepted_tokens"] = fused["stats"]["expected_accepted_tokens"]
            row["num_accepted_tokens"] = fused["stats"]["num_accepted_tokens"]
        if (draft, k, block, "host") in measured:
            row["host_orchestrated_tok_s"] = measured[(draft, k, block, "host")]["decode_tok_s"]
            row["fused_over_host"] = fused["decode_tok_s"] / row["host_orchestrated_tok_s"]
        rows.append(row)
    return rows


def _confident(model, draft: str) -> bool:
    """Whether ``draft`` (loaded in ``model``) estimates its confidence (DSpark with the head)."""
    from mtp_jax.drafts import DRAFTS

    d = DRAFTS[draft]
    return bool(d.confidence and model.draft_config is not None and d.confidence(model.draft_config))


def _load_drafted(mtp_jax, path: str, args: argparse.Namespace) -> tuple[object, dict]:
    """The target alone (plain decoding and its own MTP), and beside each --draft-model (the one
    loaded target shared: :meth:`mtp_jax.Model.with_draft`). Returns (the target, {draft method:
    the model that drafts with it})."""
    model = mtp_jax.load(path, dtype=args.dtype)
    owners = {d: model for d in model.drafts}
    for directory in args.draft_model:
        drafted = model.with_draft(directory)
        for d in drafted.drafts:
            if d not in owners:
                owners[d] = drafted
            elif owners[d] is not model:
                raise ValueError(f"two --draft-model directories both draft with {d!r}")
    return model, owners


def label(row: dict) -> str:
    """A row's draft, with its DFlash block size when it has one."""
    name = row.get("draft") or "plain"
    if row.get("auto_k"):
        return f"{name} (auto K)"
    if row.get("scheduled_plain"):
        name = f"{name}, confidence schedule: plain (no width pays)"
    elif row.get("schedule") == "confidence":
        name = f"{name}, confidence schedule"
    return f"{name} (block {row['block_size']})" if "block_size" in row else name


def table(report: dict) -> str:
    lines = [
        "| batch | draft | K | acceptance length | acceptance by position | decode tok/s | vs plain | "
        "fused / host |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        by_pos = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"]) or "-"
        ratio = f"{r['fused_over_host']:.2f}x" if "fused_over_host" in r else "-"
        vs = f"{r['speedup_vs_plain']:.2f}x" if r["speedup_vs_plain"] is not None else "-"
        lines.append(
            f"| {r['batch']} | {label(r)} | {r['k']} | {r['acceptance_length']:.2f} | "
            f"{by_pos} | {r['decode_tok_s']:.1f} | {vs} | {ratio} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Acceptance rate by draft position (one line per K) and speed-up over plain decoding by K."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'mtp-jax[plot]'") from e
    rows = report["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    first_batch = rows[0]["batch"]
    for r in rows:
        if r["batch"] == first_batch and r["k"] > 0:
            pos = range(1, len(r["acceptance_by_position"]) + 1)
            left.plot(pos, r["acceptance_by_position"], marker="o", label=f"{label(r)} K={r['k']}")
    left.set(
        xlabel="draft position",
        ylabel="fraction of steps accepting it",
        title=f"Acceptance by position (batch {first_batch})",
        ylim=(0, 1),
    )
    left.legend()
    for b, draft in sorted({(r["batch"], label(r)) for r in rows if r["draft"]}):
        pts = [
            (r["k"], r["speedup_vs_plain"])
            for r in rows
            if r["batch"] == b and label(r) == draft and r["speedup_vs_plain"]
        ]
        right.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=f"{draft}, batch {b}")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(xlabel="K (drafts per step)", ylabel="decode tok/s vs plain", title="Speed-up over plain")
    right.legend()
    fig.suptitle(f"{report['model']} on {report['device']}, temperature {report['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        report = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(report))
    if args.json:
        write_json(args.json, report)
    if args.auto_k_table:
        from mtp_jax import autok

        tables = autok.best_k(report["results"])
        if not tables:
            print("error: --auto-k-table needs plain decoding (--k 0) and a draft measured", file=sys.stderr)
            return 2
        keys = ("model", "dtype", "temperature", "draft_sampling", "device", "cpu_count")
        meta = {k: report[k] for k in keys}
        autok.write(args.auto_k_table, tables, meta)
        print(f"auto-K table: {tables} -> {args.auto_k_table}", file=sys.stderr)
    if args.plot:
        plot(report, args.plot)
    return 0
