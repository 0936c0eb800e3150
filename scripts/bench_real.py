"""A real model against the engines people already use, on this machine, in one run.

    python scripts/bench_real.py --json benchmarks/smollm2/cpu.json \\
        --eagle3 checkpoints/smollm2-135m-instruct-eagle3 --dflash checkpoints/smollm2-135m-instruct-dflash

The target is SmolLM2-135M-Instruct (``--model``, default the packaged ``smollm2-135m-instruct``, a
Q4_1 GGUF), in float32 everywhere: mtp-jax and ``transformers`` (torch, CPU) both run the same
dequantised weights (each through its own GGUF reader); llama.cpp (``llama-cpp-python``, built
from source, a benchmark-only peer) runs the GGUF as shipped (Q4_1) and an F32 GGUF of the same
weights written here with the ``gguf`` package (``--f32-gguf``).

Prompts: the held-out chat and code prompts of ``scripts/distill.py`` (never trained on),
and with ``--kinds edit`` requests whose reply repeats the input (a held-out function returned
whole with a docstring added), rendered with the model's chat template; every engine gets the same
token ids and generates ``--new-tokens`` tokens past any end of turn. Rates are end to end
(prefill included) over the timed repeats after one untimed warm-up, median of ``--repeats``;
mtp-jax's rows also give the time per output token (``tpot_ms``: a request's first token to its
last over the tokens after the first, the mean over requests; what speculation changes, without the
prefill that both columns pay);
batch B runs B prompts at once where the engine can (llama-cpp-python has no batched API: batch
1 only). Configurations:

* mtp-jax: plain; n-gram prompt lookup at each ``--ngram-k`` (no weights: the counterpart of the
  peers' prompt lookup); EAGLE-3 at each ``--k``; DFlash at each ``--block-size`` (a whole block of
  drafts); auto K (``--auto-k`` table) at batch > 1;
* transformers: ``generate`` plain, and with prompt lookup (``prompt_lookup_num_tokens``, batch 1);
* llama.cpp: plain and with its prompt-lookup draft (``LlamaPromptLookupDecoding``), Q4_1 and F32.

Each peer runs in a process of its own (``--peer``), so no two runtimes share threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))


KINDS = ("chat", "code", "edit")


def prompt_ids(codec, per_kind: int, kinds: tuple[str, ...] = ("chat", "code")) -> dict[str, list[list[int]]]:
    """Held-out prompts by kind ("chat", "code": :func:`distill.heldout_prompts`; "edit": a
    function to return whole with a docstring added, output that repeats the input,
    :func:`distill.edit_prompts`), as chat-rendered token ids (a model without a chat
    template, a base model, gets the prompt's text as a completion)."""
    from mtp_jax.train import distill

    out: dict[str, list[list[int]]] = {kind: [] for kind in kinds}
    found = distill.heldout_prompts(per_kind) if {"chat", "code"} & set(kinds) else []
    if "edit" in kinds:
        found += distill.edit_prompts(per_kind)
    for p in found:
        if p["kind"] in out:
            if codec.chat_template is None:  # a base model (Gemma 3 270M): the prompt as a completion
                out[p["kind"]].append(codec.encode(p["text"]))
            else:
                out[p["kind"]].append(codec.encode_chat([{"role": "user", "content": p["text"]}]))
    return out


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one untimed warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def batches(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    return [prompts[i : i + batch] for i in range(0, len(prompts), batch)]


# --- peers, each in its own process --------------------------------------------------------------
def peer_transformers(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    directory, name = os.path.split(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    rows = []
    for temperature in args.temperature:
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": args.top_p}
            if temperature
            else {"do_sample": False}
        )
        for batch in args.batch:
            for lookup in (False, True):
                if lookup and batch > 1:
                    continue  # transformers' prompt lookup takes one sequence at a time
                extra = {"prompt_lookup_num_tokens": 10} if lookup else {}

                def run(batch=batch, extra=extra, sampling=sampling):
                    for chunk in batches(prompts, batch):
                        width = max(len(p) for p in chunk)
                        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
                        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                        with torch.no_grad():
                            model.generate(
                                ids,
                                attention_mask=mask,
                                max_new_tokens=args.new_tokens,
                                min_new_tokens=args.new_tokens,
                                pad_token_id=0,
                                **sampling,
                                **extra,
                            )

                seconds = timed(run, args.repeats)
                rows.append(
                    {
                        "engine": "transformers",
                        "config": "prompt lookup" if lookup else "plain",
                        "weights": "float32",
                        "batch": batch,
                        "temperature": temperature,
                        "top_p": args.top_p if temperature else 1.0,
                        "tok_s": len(prompts) * args.new_tokens / seconds,
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
    return rows


def peer_llama_cpp(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    rows = []
    files = [("Q4_1", args.gguf)] + ([("float32", args.f32_gguf)] if args.f32_gguf else [])
    for weights, path in files:
        for lookup in (False, True):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
            llm = Llama(
                model_path=path,
                n_ctx=2048,
                n_threads=os.cpu_count(),
                logits_all=False,
                verbose=False,
                draft_model=draft,
                seed=0,
            )
            for temperature in args.temperature:

                def run(llm=llm, temperature=temperature):
                    for p in prompts:
                        llm.reset()
                        tokens = llm.generate(
                            p, temp=temperature, top_k=0, top_p=args.top_p, min_p=0.0, repeat_penalty=1.0
                        )
                        for n, _ in enumerate(tokens, start=1):
                            if n >= args.new_tokens:
                                break

                seconds = timed(run, args.repeats)
                rows.append(
                    {
                        "engine": "llama.cpp",
                        "config": "prompt lookup" if lookup else "plain",
                        "weights": weights,
                        "batch": 1,
                        "temperature": temperature,
                        "top_p": args.top_p if temperature else 1.0,
                        "tok_s": len(prompts) * args.new_tokens / seconds,
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
            del llm
    return rows


# --- mtp-jax ----------------------------------------------------------------------------------
def ours(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    import mtp_jax

    model = mtp_jax.load(args.model, "float32")
    owners = {None: model}  # owner key -> the model that runs it (a draft loaded beside the target)
    if args.eagle3:  # each draft beside the one loaded target (Model.with_draft: nothing reloaded)
        owners["eagle3"] = model.with_draft(args.eagle3)
    dflash = {}  # owner key -> label suffix: several DFlash drafts side by side (e.g. two vocabularies)
    for i, path in enumerate(args.dflash or []):
        key = "dflash" if i == 0 else f"dflash{i}"
        owners[key] = model.with_draft(path)
        dflash[key] = f" ({os.path.basename(os.path.normpath(path))})" if len(args.dflash) > 1 else ""
    owners["ngram"] = model  # prompt lookup: no weights (the peers' prompt lookup, on device)
    configs: list[tuple[str | None, dict, str]] = [(None, {}, "plain")]
    configs += [("ngram", {"num_speculative_tokens": k}, f"n-gram K={k}") for k in args.ngram_k]
    if args.eagle3:
        configs += [("eagle3", {"num_speculative_tokens": k}, f"EAGLE-3 K={k}") for k in args.k]
    for key, suffix in dflash.items():
        configs += [
            (key, {"draft_block_size": b, "num_speculative_tokens": b - 1}, f"DFlash block {b}{suffix}")
            for b in args.block_size
        ]
    rows = []
    for temperature in args.temperature:
        for batch in args.batch:
            todo = list(configs)
            if args.auto_k and batch > 1:
                todo += [
                    (m, {"num_speculative_tokens": max(args.k), "auto_k": args.auto_k}, f"{m} auto K")
                    for m in ("eagle3", "dflash")
                    if owners.get(m) is not None
                ]
            for owner, kwargs, label in todo:
                stats, tpots = {}, []
                method = "dflash" if owner in dflash else owner

                def run(
                    owner=owner,
                    method=method,
                    kwargs=kwargs,
                    stats=stats,
                    tpots=tpots,
                    batch=batch,
                    temperature=temperature,
                ):
                    r = owners[owner].generate(
                        prompts,
                        max_new_tokens=args.new_tokens,
                        ignore_eos=True,
                        max_batch=batch,
                        temperature=temperature,
                        top_p=args.top_p if temperature else 1.0,
                        seed=0,
                        draft=method,
                        **kwargs,
                    )
                    stats.update(r.stats)
                    tpots.append(r.stats["mean_time_per_output_token_seconds"])

                seconds = timed(run, args.repeats)
                tpot = statistics.median(tpots[1:])  # the timed runs'; the first is the warm-up
                rows.append(
                    {
                        "engine": "mtp-jax",
                        "config": label,
                        "weights": "float32",
                        "batch": batch,
                        "temperature": temperature,
                        "top_p": args.top_p if temperature else 1.0,
                        "tok_s": len(prompts) * args.new_tokens / seconds,
                        "acceptance_length": stats.get("acceptance_length"),
                        # decoding alone: a request's first token to its last (prefill and waiting left out)
                        "tpot_ms": tpot * 1e3,
                        "decode_tok_s_per_request": 1 / tpot,
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
    return rows


def write_f32_gguf(src: str, dst: str) -> None:
    """The same model with every tensor dequantised to F32 (metadata copied), via the gguf writer."""
    import gguf
    import numpy as np

    from mtp_jax.checkpoint.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(src)
    reader = ckpt._reader
    writer = gguf.GGUFWriter(dst + ".tmp", ckpt.architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for name in ckpt.tensor_names():
        writer.add_tensor(name, np.ascontiguousarray(ckpt.array(name).astype(np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dst + ".tmp", dst)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--eagle3", help="an EAGLE-3 draft for the model")
    parser.add_argument("--dflash", nargs="+", help="DFlash drafts for the model (several: each is timed)")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--block-size", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--ngram-k", type=int, nargs="*", default=[3, 10], help="n-gram prompt lookup at these K (none: skip)"
    )
    parser.add_argument("--auto-k", help="an auto-K table (mtp-jax bench --auto-k-table) for batch > 1")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling at temperature > 0 (1: off), every engine"
    )
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per kind")
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=["chat", "code"],
        help="prompt kinds, run together (edit: return a function whole with a docstring added, "
        "output that repeats the input, where prompt lookup pays)",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peers", nargs="*", default=["transformers", "llama.cpp"])
    parser.add_argument("--f32-gguf", help="an F32 GGUF of the model (written here when missing)")
    parser.add_argument("--peer", choices=["transformers", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--json", required=True, help="write the results here")
    args = parser.parse_args()

    from mtp_jax.bench import machine_info, write_json
    from mtp_jax.embedded import resolve_model_path
    from mtp_jax.text import TextCodec

    args.gguf = resolve_model_path(args.model)
    codec = TextCodec.for_path(args.gguf)
    by_kind = prompt_ids(codec, args.prompts, tuple(args.kinds))
    prompts = [p for kind in args.kinds for p in by_kind[kind]]
    if args.peer:  # a child: one peer, rows to --json
        rows = {"transformers": peer_transformers, "llama.cpp": peer_llama_cpp}[args.peer](args, prompts)
        write_json(args.json, {"rows": rows})
        return 0
    if "llama.cpp" in args.peers and args.f32_gguf and not os.path.isfile(args.f32_gguf):
        print(f"writing {args.f32_gguf} ...", file=sys.stderr)
        write_f32_gguf(args.gguf, args.f32_gguf)
    rows = ours(args, prompts)
    for peer in args.peers:
        out = f"{args.json}.{peer}.tmp"
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--peer", peer, "--json", out]
        if subprocess.call(cmd) == 0:
            with open(out, encoding="utf-8") as f:
                rows += json.load(f)["rows"]
            os.remove(out)
        else:
            print(f"peer {peer} failed (see above); its rows are left out", file=sys.stderr)
    report = {
        "command": " ".join(["python", "scripts/bench_real.py", *sys.argv[1:]]),
        "model": args.model,
        "prompts": {k: len(v) for k, v in by_kind.items()},
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **machine_info(),
        "rows": rows,
    }
    write_json(args.json, report)
    for r in rows:
        acc = f", acceptance {r['acceptance_length']:.2f}" if r.get("acceptance_length") else ""
        acc += f", {r['tpot_ms']:.1f} ms per token decoding" if r.get("tpot_ms") else ""
        print(
            f"{r['engine']:13s} {r['config']:18s} {r['weights']:8s} batch {r['batch']} T={r['temperature']}: "
            f"{r['tok_s']:.1f} tok/s{acc}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
