"""``mtp-jax``: the command-line interface.

    mtp-jax generate [--model DIR] --prompt TEXT [sampling options]
    mtp-jax score [--model DIR] --text TEXT
    mtp-jax convert SRC DST [--weights bf16|fp32|fp8] [--strict] [--no-mtp] [--dry-run]
    mtp-jax inspect (DIR | --config config.json) [--weights ...] [--mesh data=1,expert=8]
    mtp-jax bench [--model DIR] [--k 0 1 2 3 4] [--batch 1 8] [--json F] [--plot F.png]
    mtp-jax plan (DIR | --config config.json) [--mesh data=1,expert=8] [--batch 8] [--max-len 4096]

Without --model, the embedded default in ``checkpoints/`` is used (or $MTP_JAX_MODEL).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence

from mtp_jax.embedded import default_model_dir


class CliError(Exception):
    """A problem with the command line or its inputs, printed without a traceback."""


def _model_dir(arg: str | None) -> str:
    """The model of --model: a checkpoint directory, a GGUF file or a packaged model's name
    (``smollm2-135m-instruct``); the embedded default model without one."""
    from mtp_jax.checkpoint.gguf import is_gguf
    from mtp_jax.embedded import resolve_model_path

    path = arg or default_model_dir()
    if path is None:
        raise CliError("no --model given and no embedded default model found (set --model DIR)")
    try:
        path = resolve_model_path(path)
    except FileNotFoundError as e:
        raise CliError(str(e)) from None
    if os.path.isfile(path):
        if not is_gguf(path):
            raise CliError(f"{path} is a file but not a GGUF file; --model takes a directory or a .gguf file")
        return path
    if not os.path.isdir(path):
        raise CliError(f"model directory not found: {path}")
    return path


def _tokenizer(model_path: str):
    """The model's :class:`~mtp_jax.text.TextCodec` (a GGUF file carries its own tokenizer)."""
    from mtp_jax.text import TextCodec

    if os.path.isdir(model_path) and not os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        raise CliError(f"no tokenizer.json in {model_path}; the CLI needs one beside the weights")
    return TextCodec.for_path(model_path)


def _draft_metavar() -> str:
    """``{auto,<every registered draft>,none}``: the --draft values, read from the registry."""
    from mtp_jax.drafts import draft_methods

    return "{" + ",".join(("auto", *draft_methods(), "none")) + "}"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="checkpoint directory in Hugging Face layout, a .gguf file, or a packaged model "
        "(smollm2-135m-instruct; default: the embedded model)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtp-jax", description="Speculative decoding for DeepSeek-V3 and Llama 3 in JAX"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_tool_parsers(sub)
    _add_plan_parser(sub)
    return parser


def _add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_common(g)
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    g.add_argument(
        "--chat",
        action="append",
        default=[],
        metavar="MESSAGE",
        help="a user message, rendered with the model's chat template (repeat for a batch)",
    )
    g.add_argument("--system", help="a system message for every --chat prompt")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    _add_generate_speculation_args(g)
    gram = g.add_mutually_exclusive_group()
    gram.add_argument(
        "--json-schema", metavar="FILE", help="constrain every output to this JSON schema (needs llguidance)"
    )
    gram.add_argument("--regex", metavar="PATTERN", help="constrain every output to this regular expression")
    gram.add_argument("--lark", metavar="FILE", help="constrain every output to this Lark grammar")


def _add_schedule_args(g) -> None:
    """--schedule and --sps-table: confidence-scheduled verification (:mod:`mtp_jax.schedule`)."""
    g.add_argument(
        "--schedule",
        choices=["fixed", "confidence"],
        default="fixed",
        help="verify every proposed draft, or each step the width a draft's confidences and the "
        "measured speeds pick (a draft with a confidence head: dspark)",
    )
    g.add_argument(
        "--sps-table",
        metavar="FILE",
        help="--schedule confidence: steps/s per width from mtp-jax bench --sps-table (default: measured)",
    )


def _add_generate_speculation_args(g: argparse.ArgumentParser) -> None:
    """generate's draft, speculation and relaxed-acceptance flags."""
    g.add_argument(
        "--draft",
        metavar=_draft_metavar(),
        default="auto",
        help="speculative decoding draft (any registered draft method): auto = the --draft-model when "
        "given, else the checkpoint's MTP layer when it has one; ngram = prompt lookup, suffix = suffix "
        "decoding (no weights, any model); none = plain",
    )
    g.add_argument("--draft-model", help="a separately trained draft's directory (EAGLE-3 or DFlash)")
    add_window_cache(g)
    g.add_argument(
        "--lora",
        metavar="DIR",
        help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) every "
        "prompt decodes with",
    )
    g.add_argument(
        "--draft-layer-ids",
        choices=["inputs", "outputs"],
        default="inputs",
        help="read the draft config's captured-layer ids as target layer inputs (vLLM) or outputs (SGLang)",
    )
    g.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="drafts per step (default 3 when drafting)",
    )
    g.add_argument(
        "--speculative-tree",
        type=_tree_arg,
        default=None,
        metavar="DEPTH,TOPK[,NODES][,dynamic]",
        help="verify a token tree each step instead of a chain of -k drafts: each node's TOPK likeliest "
        "continuations up to DEPTH, the NODES likeliest drafts (default: all); with ',dynamic' each row's "
        "own shape every step (EAGLE-2: the NODES of highest cumulative draft probability); mtp, eagle3, "
        "draft_model, and suffix (dynamic only: the likeliest continuations seen)",
    )
    g.add_argument(
        "--draft-block-size",
        type=int,
        default=None,
        help="DFlash: tokens per proposed block (default: the draft's trained block; -k: one less)",
    )
    _add_draft_option(g)
    g.add_argument(
        "--draft-sampling",
        choices=["argmax", "sampled"],
        default="argmax",
        help="propose the draft's argmax, or sample drafts and accept with min(1, p/q)",
    )
    _add_schedule_args(g)
    g.add_argument(
        "--auto-k",
        metavar="FILE",
        help="cap -k by the batch size with a table measured by mtp-jax bench --auto-k-table",
    )
    g.add_argument(
        "--relaxed-topk",
        type=int,
        default=0,
        help="inside <think>...</think>: also accept a draft among the target's top N (lossy; 0 = off)",
    )
    g.add_argument(
        "--relaxed-delta",
        type=float,
        default=0.0,
        help="with --relaxed-topk: the draft's probability must be >= the top one's minus this",
    )
    g.add_argument(
        "--think-tokens",
        type=int,
        nargs=2,
        metavar=("START", "END"),
        help="ids that open and close a thinking phase (default: the tokenizer's <think> and </think>)",
    )


def _add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install 'mtp-jax[serve]')")
    _add_common(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument(
        "--port", type=int, default=8000, help="0: a free port, reported in the 'listening on' line"
    )
    sv.add_argument(
        "--served-model-name",
        help="the model's name in the API (default: a packaged model's name as given, else the directory's)",
    )
    add_server_args(sv)
    sv.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    sv.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="tokens per request, prompt included (default: the model's maximum, at most 4096)",
    )
    sv.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot")
    sv.add_argument(
        "--warmup",
        choices=["background", "first", "none"],
        default="background",
        help="compile every program requests can need: while idle (background), before serving (first), "
        "or only as requests first need them (none)",
    )
    sv.add_argument(
        "--draft",
        metavar=_draft_metavar(),
        default="auto",
        help="auto = the --draft-model when given, else the checkpoint's MTP layer; ngram = prompt "
        "lookup, suffix = suffix decoding (no weights); none = plain",
    )
    sv.add_argument(
        "--draft-model", help="a separately trained draft's directory (EAGLE-3, DFlash, or a draft model)"
    )
    add_window_cache(sv)
    sv.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="drafts per step (3)")
    sv.add_argument("--draft-sampling", choices=["argmax", "sampled"], default="argmax")
    _add_draft_option(sv)
    _add_schedule_args(sv)
    sv.add_argument(
        "--speculative-tree",
        type=_tree_arg,
        default=None,
        metavar="DEPTH,TOPK[,NODES][,dynamic]",
        help="verify a token tree each step instead of a chain (see generate --help)",
    )
    sv.add_argument("--grammar-masks", choices=["host", "callback"], default="host")


def _add_tool_parsers(sub) -> None:
    """score, convert, inspect, and the bench commands (their own parsers parse them)."""
    s = sub.add_parser("score", help="per-token log-probabilities and perplexity of a text")
    _add_common(s)
    s.add_argument("--text", required=True)

    c = sub.add_parser(
        "convert", help="convert a Hugging Face checkpoint or GGUF file to an orbax checkpoint"
    )
    c.add_argument(
        "src",
        help="source: a checkpoint directory (config.json + *.safetensors), a .gguf file or a packaged model",
    )
    c.add_argument("dst", help="destination directory (must not exist)")
    c.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "bf16", "fp32", "fp8"],
        help="stored weights: auto = each tensor's own precision (FP8 kept with its scales, BF16 and FP32 "
        "as they are: loads exactly as the source does); bf16/fp32 = all dense in that dtype (FP8 "
        "dequantised); fp8 = FP8 kept, the rest bf16",
    )
    c.add_argument("--strict", action="store_true", help="refuse unexpected tensors instead of warning")
    c.add_argument("--no-mtp", action="store_true", help="leave out the MTP/NextN layers")
    c.add_argument("--dry-run", action="store_true", help="print the estimates from config.json and stop")
    _add_estimate_options(c)

    i = sub.add_parser("inspect", help="parameter counts and memory estimates from config.json alone")
    i.add_argument(
        "model", nargs="?", help="checkpoint directory (reads its config.json) or GGUF file (its metadata)"
    )
    i.add_argument("--config", help="a config.json file instead of a directory")
    i.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "bf16", "fp32", "fp8"],
        help="weights as loaded: auto = as the checkpoint stores them (config.json's quantization_config "
        "and torch_dtype)",
    )
    _add_estimate_options(i)
    sub.add_parser(
        "bench", help="plain vs speculative decode throughput and acceptance (mtp-jax bench --help)"
    )
    sub.add_parser(
        "bench-acceptance",
        help="drafts on MT-Bench, HumanEval, MBPP, GSM8K or your prompt files: accepted length per step, "
        "per position, speed against plain (mtp-jax bench-acceptance --help)",
    )


def _add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="compile the unified step from abstract shapes on simulated devices: per-device memory and "
        "compile time, no weights needed",
    )
    p.add_argument("model", nargs="?", help="checkpoint directory (reads its config.json)")
    p.add_argument("--config", help="a config.json file instead of a directory")
    p.add_argument(
        "--mesh",
        default=None,
        help="mesh axes, e.g. data=1,expert=8 (the default for DeepSeek-V3) or data=1,tensor=8 (Llama's)",
    )
    p.add_argument("--batch", type=int, default=8, help="decode rows (slots)")
    p.add_argument("--max-len", type=int, default=4096, help="KV-cache tokens per row")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "-k",
        type=int,
        default=None,
        help="drafts per step; 0 = plain decoding (default: 3 with an MTP layer or --draft-config)",
    )
    p.add_argument(
        "--draft-config",
        metavar="FILE",
        help="plan a separately trained draft beside the target (EAGLE-3 or DFlash): its config.json",
    )
    p.add_argument(
        "--draft-layer-ids",
        default="inputs",
        choices=["inputs", "outputs"],
        help="how the draft config's eagle_aux_hidden_state_layer_ids are read (as load() reads them)",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="a registered draft by name (e.g. ngram, or a plug-in); default: the MTP layer, or the "
        "--draft-config's draft",
    )
    p.add_argument(
        "--weights",
        default=None,
        choices=["fp8", "bf16"],
        help="default: fp8 for an FP8 checkpoint's config, else bf16",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activations/cache")
    p.add_argument(
        "--prefill-len",
        type=int,
        default=0,
        help="also compile prefill of prompts this long, one per row shard (0: skip)",
    )
    p.add_argument("--device-memory-gb", type=float, default=None, help="memory per device (e.g. 141)")
    p.add_argument("--json", help="also write the report as JSON to this file")
    p.add_argument(
        "--cpu-as-is",
        action="store_true",
        help="compile with every XLA:CPU pass (by default the CPU-only hoisting of FP8 converts is off)",
    )


def _add_estimate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default="data=1,expert=1", help="mesh axes, e.g. data=1,expert=8")
    p.add_argument("--kv-tokens", type=int, default=0, help="KV-cache tokens in total over all devices")
    p.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory per device, to check the fit (e.g. 141 for an H200)",
    )


def _encode(codec, text: str) -> list[int]:
    """``text`` as the tokenizer encodes a prompt (its own BOS rule)."""
    ids = codec.encode(text)
    if not ids:
        raise CliError("the text encodes to no tokens")
    return ids


def _grammar(args: argparse.Namespace) -> dict | None:
    """The --json-schema / --regex / --lark constraint, files read here with clear errors."""
    if args.regex is not None:
        return {"regex": args.regex}
    for flag, path in (("--json-schema", args.json_schema), ("--lark", args.lark)):
        if path is None:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise CliError(f"{flag}: cannot read {path}: {e.strerror}") from None
        if flag == "--lark":
            return {"lark": text}
        try:
            return {"json_schema": json.loads(text)}
        except json.JSONDecodeError as e:
            raise CliError(f"--json-schema: {path} is not valid JSON: {e}") from None
    return None


def _generate(args: argparse.Namespace) -> int:

    if not args.prompt and not args.chat:
        raise CliError("give a prompt: --prompt TEXT or --chat MESSAGE (either may repeat)")
    tok = _tokenizer(_model_dir(args.model))
    if args.chat and tok.chat_template is None:
        raise CliError("--chat needs a model with a chat template (tokenizer_config.json's chat_template)")
    _, model, draft = _load_with_draft(args)
    draft = draft or "none"
    system = [{"role": "system", "content": args.system}] if args.system else []
    prompts = [_encode(tok, text) for text in args.prompt] + [
        tok.encode_chat([*system, {"role": "user", "content": text}]) for text in args.chat
    ]
    shown = list(args.prompt) + [""] * len(args.chat)  # a chat's reply is printed alone
    grammar = _grammar(args)
    t0 = time.perf_counter()
    result = model.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        draft=None if draft == "none" else draft,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_sampling=args.draft_sampling,
        draft_block_size=args.draft_block_size,
        draft_options=dict(args.draft_option or ()),
        speculative_tree=args.speculative_tree,
        schedule=args.schedule,
        sps_table=args.sps_table,
        auto_k=args.auto_k,
        relaxed_topk=args.relaxed_topk,
        relaxed_delta=args.relaxed_delta,
        think_tokens=tuple(args.think_tokens) if args.think_tokens else None,
        grammar=grammar,
        lora=_adapter_name(args.lora) if args.lora else None,
    )
    wall = time.perf_counter() - t0
    rows = zip(shown, result.tokens, result.finish_reasons, result.request_stats, strict=True)
    for text, new, reason, rs in rows:
        if len(shown) > 1:
            print("=" * 60)
        print(text + tok.decode(new, skip_special_tokens=True))
        accepted = f" [acceptance length {rs['acceptance_length']:.2f}]" if rs["num_draft_tokens"] else ""
        print(f"[{len(new)} tokens, stopped by {reason}]{accepted}", file=sys.stderr)
    st = result.stats
    per_position = ", ".join(f"{r:.2f}" for r in st["acceptance_rate_per_position"])
    ttft, tpot = st["mean_time_to_first_token_seconds"], st["mean_time_per_output_token_seconds"]
    latency = f"; time to first token {ttft * 1e3:.0f} ms" if ttft is not None else ""
    latency += f", {tpot * 1e3:.1f} ms per token after it (means over requests)" if tpot is not None else ""
    print(
        f"[steps {st['steps']}, {st['new_tokens']} new tokens in {wall:.2f}s incl. compilation; "
        f"decode {st['decode_tokens_per_second_after_first_call']:.1f} tok/s after the first step "
        f"({st['first_step_call_seconds']:.2f}s, compiling it); "
        f"acceptance length {st['acceptance_length']:.2f}"
        + (f"; acceptance by position [{per_position}]" if per_position else "")
        + latency
        + "]",
        file=sys.stderr,
    )
    return 0


def check_draft_name(name: str, error: type[Exception]) -> None:
    """``--draft NAME``: auto, none or a registered draft method (the registry, not a fixed list)."""
    from mtp_jax.drafts import DRAFTS

    if name not in ("auto", "none", *DRAFTS):
        raise error(
            f"--draft {name!r} is not a draft method; choose auto, none or one of {', '.join(DRAFTS)}"
        )


def add_window_cache(parser) -> None:
    """--window-cache (generate, serve, scripts/launch.py)."""
    parser.add_argument(
        "--window-cache",
        choices=["pages", "ring"],
        default="pages",
        help="how sliding-window layers (Gemma 3) keep their keys: every page (default), or a ring of "
        "the window's pages per slot",
    )


def needs_draft_model(name: str) -> bool:
    """Whether the draft ``name`` is loaded from a directory of its own (--draft-model)."""
    from mtp_jax.drafts import DRAFTS

    return name in DRAFTS and DRAFTS[name].config_class is not None


def _load_with_draft(args: argparse.Namespace):
    """The model of --model (and --draft-model) and the draft --draft names (None: plain)."""
    import mtp_jax

    model_dir = _model_dir(args.model)
    print(f"loading {model_dir} ({args.dtype}) ...", file=sys.stderr)
    check_draft_name(args.draft, CliError)
    if needs_draft_model(args.draft) and args.draft_model is None:
        raise CliError(f"--draft {args.draft} needs --draft-model DIR (the draft's directory)")
    layer_ids = getattr(args, "draft_layer_ids", "inputs")
    model = mtp_jax.load(
        model_dir,
        dtype=args.dtype,
        draft_model=args.draft_model,
        draft_layer_ids=layer_ids,
        window_cache=getattr(args, "window_cache", "pages"),
        **lora_load_kwargs(args),
    )
    draft = args.draft
    if draft == "auto":
        draft = model.default_draft or "none"
    if draft == "none" and args.num_speculative_tokens is not None:
        raise CliError("-k needs a draft (the model has none of its own, or --draft none was given)")
    return model_dir, model, None if draft == "none" else draft


def add_server_args(parser) -> None:
    """The server's flags shared by ``mtp-jax serve`` and ``scripts/launch.py --serve``: access,
    request size, LoRA adapters."""
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MTP_JAX_API_KEY"),
        help="every /v1 request must carry this bearer token, else 401 (default: $MTP_JAX_API_KEY; "
        "/health and /metrics stay open)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 2**20,
        help="larger request bodies get 413 before they are read (default: 16 MiB)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a request body must arrive within S seconds (else 408) and a request running longer is "
        "cancelled (finish reason abort), its slot freed (default: no limit)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="requests whose prompts start alike share those cache pages and prefill only the rest "
        "(default: on)",
    )
    parser.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=2048,
        metavar="N",
        help="prompts longer than N tokens are prefilled N at a time between decode steps, so running "
        "requests keep streaming while a long prompt arrives (default: 2048; 0: whole prompts at once)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="on SIGTERM or SIGINT stop accepting and let the requests in flight finish for at most S "
        "seconds, then cancel them and exit (default: 60)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=DIR",
        default=[],
        help="PEFT LoRA adapters served beside the base model; a request names one as its model",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapter slots on device (default: as many as given; more leave room to load at run time)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="the largest adapter rank (default: the adapters' largest, >= 16)",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (clients then make the "
        "server read adapter directories it can reach)",
    )


def server_kwargs(args: argparse.Namespace) -> dict:
    """:func:`mtp_jax.server.serve`'s keywords from :func:`add_server_args`' flags."""
    return {
        "runtime_lora": args.allow_runtime_lora_updating,
        "api_key": args.api_key,
        "max_request_bytes": args.max_request_bytes,
        "request_timeout": args.request_timeout,
        "shutdown_timeout": args.shutdown_timeout,
        "ready": lambda port: print(
            f"listening on http://{args.host}:{port}/v1", file=sys.stderr, flush=True
        ),
    }


def lora_load_kwargs(args: argparse.Namespace) -> dict:
    """``mtp_jax.load``'s LoRA keywords from --lora (generate) or the serving flags."""
    lora = getattr(args, "lora", None)
    adapters = {_adapter_name(lora): lora} if lora else _lora_modules(getattr(args, "lora_modules", []))
    return {
        "lora_adapters": adapters,
        "max_loras": getattr(args, "max_loras", None),
        "max_lora_rank": getattr(args, "max_lora_rank", None),
    }


def _lora_modules(specs: Sequence[str]) -> dict[str, str] | None:
    """``--lora-modules NAME=DIR ...`` as {name: directory}."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CliError(f"--lora-modules takes NAME=DIR entries, got {spec!r}")
        if name in out:
            raise CliError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out or None


def _tree_arg(text: str) -> dict:
    """``--speculative-tree DEPTH,TOPK[,NODES][,dynamic]`` as the ``speculative_tree`` setting."""
    from mtp_jax.tree import tree_setting

    try:
        return tree_setting(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_draft_option(group) -> None:
    group.add_argument(
        "--draft-option",
        type=_draft_option,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a setting of the draft's own (repeatable; the value read as JSON, else text), e.g. suffix "
        "decoding's max_match=16, index_slots=0",
    )


def _draft_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of --draft-option: the value as JSON (numbers, true/false), else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _adapter_name(path: str) -> str:
    """The name a LoRA adapter directory given on the command line goes by (its directory's name)."""
    return os.path.basename(os.path.normpath(path))


def make_engine(args: argparse.Namespace, model, draft: str | None):
    """The serving engine of `mtp-jax serve`'s (or `scripts/launch.py --serve`'s) flags."""
    from mtp_jax.distributed import PEER_TIMEOUT_S
    from mtp_jax.request import SpeculativeConfig
    from mtp_jax.serving import Engine

    speculative = SpeculativeConfig(
        draft=draft,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_sampling=getattr(args, "draft_sampling", "argmax"),
        speculative_tree=getattr(args, "speculative_tree", None),
        draft_options=dict(getattr(args, "draft_option", None) or ()),
        schedule=getattr(args, "schedule", "fixed"),
        sps_table=getattr(args, "sps_table", None),
    )
    engine = Engine(
        model,
        speculative=speculative,
        slots=args.slots,
        max_len=args.max_len,
        max_queue=args.max_queue,
        grammar_masks=getattr(args, "grammar_masks", "host"),
        prefix_caching=getattr(args, "enable_prefix_caching", True),
        chunked_prefill_size=getattr(args, "chunked_prefill_size", 2048) or None,
        peer_timeout_s=getattr(args, "peer_timeout", PEER_TIMEOUT_S),
    )
    mode = getattr(args, "warmup", "background")
    if engine.leader and mode != "none":  # the other processes of a run follow process 0's
        t0 = time.perf_counter()
        tty = sys.stderr.isatty()

        def progress(done: int, total: int) -> None:
            if mode == "background":
                if done == total:
                    print(f"warm-up done: {total} programs compiled", file=sys.stderr, flush=True)
            elif tty or done == total or done % 10 == 0:
                end = "\n" if done == total or not tty else ""
                line = f"\rcompiling the engine's programs: {done}/{total}"
                print(line, end=end, file=sys.stderr, flush=True)

        if mode == "first":
            n = engine.warmup(progress)
            print(f"{n} programs compiled in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        else:
            n = engine.warmup(progress, background=True)
            print(f"compiling {n} programs in the background while no request runs", file=sys.stderr)
    return engine


def default_served_name(model_arg: str | None, model_dir: str) -> str:
    """The model's name in the API without --served-model-name: a packaged model's name as the user
    gave it (``gemma-3-270m``, not its file's), else the directory's or file's base name."""
    from mtp_jax.embedded import PACKAGED_MODELS

    if model_arg in PACKAGED_MODELS:
        return model_arg
    return os.path.basename(os.path.abspath(model_dir))


def _serve(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise CliError("mtp-jax serve needs the serve extra: pip install 'mtp-jax[serve]'") from None
    from mtp_jax.server import serve

    model_dir, model, draft = _load_with_draft(args)
    engine = make_engine(args, model, draft)
    name = args.served_model_name or default_served_name(args.model, model_dir)
    speculation = f"{draft}, K = {engine.sc.k}" if draft else "none"
    print(
        f"serving {name} on http://{args.host}:{args.port}/v1 ({engine.slots} slots x {engine.max_len} "
        f"tokens; speculation: {speculation})",
        file=sys.stderr,
    )
    try:
        serve(engine, name, host=args.host, port=args.port, **server_kwargs(args))
    finally:
        engine.close()
    if engine.failed:
        print(f"mtp-jax serve: the engine failed: {engine.failure}", file=sys.stderr)
        return 1
    return 0


def _score(args: argparse.Namespace) -> int:
    import mtp_jax

    model_dir = _model_dir(args.model)
    tok = _tokenizer(model_dir)
    model = mtp_jax.load(model_dir, dtype=args.dtype)
    ids = _encode(tok, args.text)
    if len(ids) < 2:
        raise CliError("the text is too short to score: it needs at least two tokens")
    result = model.score(ids)
    print(f"{'pos':>5} {'token':>7}  {'logprob':>9}  text")
    for i, (tid, lp) in enumerate(zip(ids[1:], result.logprobs, strict=True), start=1):
        print(f"{i:>5} {tid:>7}  {lp:>9.4f}  {tok.decode([tid], skip_special_tokens=False)!r}")
    total = sum(result.logprobs)
    print(
        f"tokens scored: {len(result.logprobs)}  total logprob: {total:.4f}  "
        f"mean: {total / len(result.logprobs):.4f}  perplexity: {result.perplexity:.4f}"
    )
    if not math.isfinite(result.perplexity):
        print("warning: perplexity is not finite", file=sys.stderr)
    return 0


def _parse_mesh(text: str) -> dict[str, int]:
    mesh = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise CliError(f"--mesh must look like data=1,expert=8; got {text!r}")
        mesh[name.strip()] = int(value)
    return mesh


def _read_config(path: str) -> dict:
    from mtp_jax.model import read_model_config

    return read_model_config(path)


def _print_estimates(raw: dict, weights: str, args: argparse.Namespace) -> None:
    from mtp_jax.config import parse_config
    from mtp_jax.estimate import format_report, stored_format

    cfg = parse_config(raw)
    if weights == "auto":
        weights = stored_format(cfg, raw)
    try:
        print(format_report(cfg, weights, _parse_mesh(args.mesh), args.kv_tokens, args.device_memory_gb))
    except ValueError as e:
        raise CliError(str(e)) from None


def _convert(args: argparse.Namespace) -> int:
    from mtp_jax.checkpoint.convert import convert

    src = _model_dir(args.src)
    if args.dry_run:
        _print_estimates(_read_config(src), args.weights, args)
        return 0
    try:
        report = convert(src, args.dst, weights=args.weights, mtp=not args.no_mtp, strict=args.strict)
    except FileExistsError as e:
        raise CliError(str(e)) from None
    rate = report.bytes_read / max(report.seconds, 1e-9) / 1e6
    resumed = f", {report.groups_resumed} resumed" if report.groups_resumed else ""
    print(
        f"wrote {report.dst}: {report.groups} groups{resumed}, {report.tensors} tensors, "
        f"{report.bytes_read / 1e6:.1f} MB read in {report.seconds:.1f}s ({rate:.1f} MB/s)"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.config is None):
        raise CliError("give either a checkpoint directory (or GGUF file) or --config FILE")
    path = args.config or _model_dir(args.model)
    if args.model and os.path.isfile(path):  # a GGUF file (_model_dir refuses other files)
        from mtp_jax.checkpoint.gguf import GGUFCheckpoint

        print(describe_gguf(GGUFCheckpoint(path)))
        print()
    _print_estimates(_read_config(path), args.weights, args)
    return 0


def describe_gguf(ckpt) -> str:
    """What a GGUF file holds: its model, tensor types, tokenizer and chat template."""
    from collections import Counter

    from mtp_jax.progress import human_bytes

    meta = ckpt.metadata
    types = Counter(ckpt.tensor_type(n) for n in ckpt.tensor_names())
    tokens = meta.get("tokenizer.ggml.tokens") or []
    lines = [
        f"GGUF file {ckpt.path} ({human_bytes(os.path.getsize(ckpt.path))})",
        f"  model: {meta.get('general.name', '?')} (architecture {ckpt.architecture}, "
        f"license {meta.get('general.license', '?')})",
        f"  tensors: {len(ckpt.tensor_names())} ("
        + ", ".join(f"{n} {t}" for t, n in types.most_common())
        + "); dequantised to the model dtype when loaded",
        f"  tokenizer: {meta.get('tokenizer.ggml.model', 'none')} (pre-tokenizer "
        f"{meta.get('tokenizer.ggml.pre', 'default')}), {len(tokens)} tokens, BOS added: "
        f"{bool(meta.get('tokenizer.ggml.add_bos_token', False))}",
        f"  chat template: {'yes' if isinstance(meta.get('tokenizer.chat_template'), str) else 'no'}",
    ]
    return "\n".join(lines)


def _plan(args: argparse.Namespace, argv: list[str]) -> int:
    import json
    import subprocess

    from mtp_jax.config import parse_config, read_json
    from mtp_jax.drafts import DRAFTS, draft_for_config, parse_draft_config
    from mtp_jax.plan import check_plan, format_plan, plan, request_host_devices
    from mtp_jax.targets import target_for

    if (args.model is None) == (args.config is None):
        raise CliError("give either a checkpoint directory or --config FILE")
    path = args.config or os.path.join(args.model, "config.json")
    cfg = parse_config(read_json(path, what="config"))
    draft_cfg = None
    if args.draft_config:
        raw = read_json(args.draft_config, what="draft config")
        draft_cfg = parse_draft_config(raw, cfg.num_hidden_layers, args.draft_layer_ids, cfg.vocab_size)
    k = args.k
    if k is None:
        k = 0
        named = args.draft or target_for(cfg).own_draft(cfg)
        method = draft_for_config(draft_cfg) if draft_cfg is not None else DRAFTS.get(named)
        if method is not None:  # the draft's own default, as generate() takes it
            k = method.default_k if method.configure is None else method.configure(draft_cfg, None, {})[1]
    options = {
        "batch": args.batch,
        "max_len": args.max_len,
        "page_size": args.page_size,
        "k": k,
        "weights": args.weights or ("fp8" if cfg.quantization_config is not None else "bf16"),
        "prefill_len": args.prefill_len,
        "draft_cfg": draft_cfg,
        "draft": args.draft,
    }
    mesh = args.mesh or f"data=1,{target_for(cfg).split_axis}=8"
    try:  # before any device exists: a bad request never waits for a re-run or a compile
        axes = check_plan(cfg, _parse_mesh(mesh), **options)
    except ValueError as e:
        raise CliError(str(e)) from None
    devices = math.prod(axes.values())
    if not request_host_devices(devices):
        print(
            f"mtp-jax plan: JAX is already running with fewer than {devices} devices; re-running in a "
            f"child process with XLA_FLAGS={os.environ['XLA_FLAGS']!r}",
            file=sys.stderr,
        )
        return subprocess.call([sys.executable, "-m", "mtp_jax.cli", *argv], env=os.environ.copy())
    try:
        report = plan(
            cfg,
            axes,
            **options,
            dtype=args.dtype,
            cpu_as_is=args.cpu_as_is,
            log=sys.stderr,
            model=os.path.basename(os.path.dirname(os.path.abspath(path))) if args.model else path,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    print(format_plan(report, args.device_memory_gb))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=2)
            f.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (shared with scripts/bench.py)
        from mtp_jax.bench import main as bench_main

        return bench_main(argv[1:], prog="mtp-jax bench")
    if argv[:1] == ["bench-acceptance"]:  # its own parser too
        from mtp_jax.acceptance import main as acceptance_main

        return acceptance_main(argv[1:])
    args = _build_parser().parse_args(argv)
    from mtp_jax.errors import MtpJaxError

    try:
        commands = {
            "generate": _generate,
            "serve": _serve,
            "score": _score,
            "convert": _convert,
            "inspect": _inspect,
            "plan": lambda a: _plan(a, argv),
        }
        return commands[args.command](args)
    except (CliError, MtpJaxError) as e:
        print(f"mtp-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
