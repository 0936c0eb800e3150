"""``mtp-jax``: the command-line interface.

    mtp-jax generate [--model DIR] --prompt TEXT [sampling options]
    mtp-jax score [--model DIR] --text TEXT

Without --model, the embedded default in ``checkpoints/`` is used (or $MTP_JAX_MODEL).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

DEFAULT_MODEL_NAME = "tiny-random-deepseek-v3"


def default_model_dir() -> str | None:
    env = os.environ.get("MTP_JAX_MODEL")
    if env:
        return env
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidate = os.path.join(repo, "checkpoints", DEFAULT_MODEL_NAME)
    return candidate if os.path.isdir(candidate) else None


class CliError(Exception):
    """A problem with the command line or its inputs, printed without a traceback."""


def _model_dir(arg: str | None) -> str:
    path = arg or default_model_dir()
    if path is None:
        raise CliError("no --model given and no embedded default model found (set --model DIR)")
    if not os.path.isdir(path):
        raise CliError(f"model directory not found: {path}")
    return path


def _tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise CliError(f"no tokenizer.json in {model_dir}; the CLI needs one beside the weights")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="checkpoint directory in Hugging Face layout (default: the embedded model)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtp-jax", description="Speculative decoding for DeepSeek-V3 in JAX"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_common(g)
    g.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")

    s = sub.add_parser("score", help="per-token log-probabilities and perplexity of a text")
    _add_common(s)
    s.add_argument("--text", required=True)
    return parser


def _encode(tok, text: str, bos: int | None) -> list[int]:
    ids = tok.encode(text).ids
    if bos is not None:
        ids = [bos] + ids
    if not ids:
        raise CliError("the text encodes to no tokens")
    return ids


def _generate(args: argparse.Namespace) -> int:
    import mtp_jax

    model_dir = _model_dir(args.model)
    tok = _tokenizer(model_dir)
    print(f"loading {model_dir} ({args.dtype}) ...", file=sys.stderr)
    model = mtp_jax.load(model_dir, dtype=args.dtype)
    prompts = [_encode(tok, text, model.config.bos_token_id) for text in args.prompt]
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
    )
    wall = time.perf_counter() - t0
    for text, new, reason in zip(args.prompt, result.tokens, result.finish_reasons, strict=True):
        if len(args.prompt) > 1:
            print("=" * 60)
        print(text + tok.decode(new, skip_special_tokens=True))
        print(f"[{len(new)} tokens, stopped by {reason}]", file=sys.stderr)
    st = result.stats
    print(
        f"[steps {st['steps']}, {st['new_tokens']} new tokens in {wall:.2f}s incl. compilation; "
        f"decode {st['decode_tokens_per_second']:.1f} tok/s; "
        f"acceptance length {st['acceptance_length']:.2f}]",
        file=sys.stderr,
    )
    return 0


def _score(args: argparse.Namespace) -> int:
    import mtp_jax

    model_dir = _model_dir(args.model)
    tok = _tokenizer(model_dir)
    model = mtp_jax.load(model_dir, dtype=args.dtype)
    ids = _encode(tok, args.text, model.config.bos_token_id)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from mtp_jax.errors import MtpJaxError

    try:
        return {"generate": _generate, "score": _score}[args.command](args)
    except (CliError, MtpJaxError) as e:
        print(f"mtp-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
