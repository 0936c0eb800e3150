"""Generation or a decode benchmark over one mesh spanning every process of a multi-host run.

Run the same command on every host; the cluster comes from the flags, else ``JAX_COORDINATOR_ADDRESS``
/ ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, else SLURM (``srun``), else, with ``--auto``,
``jax.distributed.initialize``'s own detection (Cloud TPU VMs). With DeepSeek-V3 each host reads
only its share of the routed experts; Llama models split heads and MLP columns over ``tensor``
(every host reads the checkpoint and keeps its devices' slices). Results are printed by process 0
only.

    # two hosts, eight devices in all, experts split over both
    python scripts/launch.py --coordinator host0:1234 --num-processes 2 --process-id 0 \\
        --mesh data=1,expert=8 --prompt "import os"          # and --process-id 1 on host1
    srun -N 2 python scripts/launch.py --mesh data=2,expert=4 --prompt "import os"
    # N processes on this machine (simulated CPU devices, gloo collectives): what the tests run
    python scripts/launch.py --local 2 --mesh data=1,expert=8 --prompt "import os" -k 3
    python scripts/launch.py --local 2 --mesh data=2,expert=4 --bench --prompt "import os" --batch 4 \
        --new-tokens 32
    python scripts/launch.py --local 2 --mesh data=2,tensor=4 --model checkpoints/tiny-llama3-stdlib \
        --prompt "import os"
    # an OpenAI-compatible server: process 0 serves HTTP, the others follow its engine step by step
    python scripts/launch.py --local 2 --mesh data=2,expert=4 --serve --port 8000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a file from a checkout
    sys.path.insert(0, REPO)

from mtp_jax.distributed import (  # noqa: E402
    PEER_TIMEOUT_S,
    LaunchError,
    initialize,
    resolve_cluster,
    spawn_local,
)

_LAUNCHER_ONLY = ("--local", "--devices-per-process", "--timeout")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/launch.py", description=__doc__.split("\n\n")[0])
    c = p.add_argument_group("cluster")
    c.add_argument("--coordinator", help="host:port of process 0's coordinator service")
    c.add_argument("--num-processes", type=int, help="processes in the run")
    c.add_argument("--process-id", type=int, help="this process's id in [0, num-processes)")
    c.add_argument("--auto", action="store_true", help="let jax.distributed detect the cluster (TPU VMs)")
    c.add_argument("--slurm-port", type=int, default=12345, help="coordinator port under SLURM")
    c.add_argument("--init-timeout", type=int, default=300, help="seconds to wait for all processes to join")
    c.add_argument("--local", type=int, metavar="N", help="run N processes on this machine (CPU devices)")
    c.add_argument("--devices-per-process", type=int, help="with --local (default: mesh size / N)")
    c.add_argument("--timeout", type=float, default=1800, help="with --local: seconds before all are stopped")
    m = p.add_argument_group("model")
    m.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    m.add_argument(
        "--mesh",
        help="mesh over all devices of the run, e.g. data=2,expert=4 or data=2,tensor=4 (default: all "
        "devices on expert for DeepSeek-V3, on tensor for Llama)",
    )
    from mtp_jax.cli import add_window_cache

    add_window_cache(m)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    g.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument(
        "--draft",
        metavar="NAME",
        default="auto",
        help="auto = the --draft-model when given, else the model's own draft (the MTP layer) when it "
        "has one, else plain decoding; none = plain decoding; else any registered draft, as "
        "mtp-jax generate --draft takes it (see its --help)",
    )
    g.add_argument(
        "--draft-model", help="a separately trained draft's directory (EAGLE-3 or DFlash), loaded on the mesh"
    )
    g.add_argument(
        "--draft-layer-ids",
        choices=["inputs", "outputs"],
        default="inputs",
        help="how an EAGLE-3 config's captured-layer ids are read (as vLLM: inputs; as SGLang: outputs)",
    )
    g.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="drafts per step (3)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--json", action="store_true", help="print one JSON object (tokens, stats) instead of text"
    )
    s = p.add_argument_group("serving (process 0 serves HTTP; the others follow its engine)")
    s.add_argument("--serve", action="store_true", help="run `mtp-jax serve` over the run's mesh")
    s.add_argument("--host", default="127.0.0.1", help="--serve: address to listen on")
    s.add_argument(
        "--port",
        type=int,
        default=8000,
        help="--serve: port (0: a free one, reported in the 'listening on' line)",
    )
    s.add_argument("--served-model-name", help="--serve: the model's name in the API")
    s.add_argument("--slots", type=int, default=8, help="--serve: requests decoded at once")
    s.add_argument("--max-len", type=int, default=None, help="--serve: tokens per request, prompt included")
    s.add_argument("--max-queue", type=int, default=256, help="--serve: requests that may wait for a slot")
    s.add_argument(
        "--peer-timeout",
        type=float,
        default=PEER_TIMEOUT_S,
        metavar="S",
        help="--serve: fail every request and exit once another process of the run has not been heard "
        "from for S seconds (default: %(default)g; JAX's own coordination service gives up after 100)",
    )
    from mtp_jax.cli import add_server_args

    add_server_args(s)
    s.add_argument(
        "--warmup",
        choices=["background", "first", "none"],
        default="background",
        help="--serve: compile every program while idle (background), before serving, or on first use",
    )
    b = p.add_argument_group("benchmark")
    b.add_argument("--bench", action="store_true", help="time decoding (after a compiling run) instead")
    b.add_argument("--batch", type=int, default=1, help="--bench: decode slots")
    b.add_argument("--new-tokens", type=int, default=32, help="--bench: tokens per prompt")
    b.add_argument("--repeats", type=int, default=3, help="--bench: timed runs (median reported)")
    return p


def _without_launcher_flags(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _LAUNCHER_ONLY:
            skip = True
        elif not a.startswith(tuple(f"{f}=" for f in _LAUNCHER_ONLY)):
            out.append(a)
    return out


def _mesh_axes(text: str | None, n_devices: int, split: str = "expert") -> dict[str, int]:
    """The mesh axes of ``--mesh``, or all devices on ``split`` (the model's model-parallel axis)."""
    from mtp_jax.cli import _parse_mesh

    axes = _parse_mesh(text) if text else {"data": 1, split: n_devices}
    unknown = set(axes) - {"data", "expert", "tensor"}
    if unknown:
        raise LaunchError(f"unknown mesh axes {sorted(unknown)}; use data, expert, tensor")
    return axes


def _prompts(args: argparse.Namespace, model_dir: str):
    """Token-id prompts from --prompt-ids and --prompt, and the tokenizer when text needs one."""
    from mtp_jax.cli import _encode, _tokenizer

    prompts = []
    for text in args.prompt_ids:
        try:
            prompts.append([int(x) for x in text.replace(" ", "").split(",") if x])
        except ValueError:
            raise LaunchError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    tok = (
        _tokenizer(model_dir)
        if args.prompt
        or os.path.isfile(model_dir)
        or os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
        else None
    )
    prompts += [_encode(tok, text) for text in args.prompt]
    return prompts, tok


def run(args: argparse.Namespace) -> int:
    """One process of the run: join the cluster, load sharded, generate or benchmark."""
    cluster = resolve_cluster(
        args.coordinator, args.num_processes, args.process_id, auto=args.auto, slurm_port=args.slurm_port
    )
    if cluster is not None:
        initialize(cluster, args.init_timeout)
    import jax

    import mtp_jax
    from mtp_jax.cli import _model_dir
    from mtp_jax.config import parse_config
    from mtp_jax.model import read_model_config
    from mtp_jax.targets.llama.config import Llama3Config

    lead = jax.process_index() == 0
    n_dev = jax.device_count()
    model_dir = _model_dir(args.model)
    llama = isinstance(parse_config(read_model_config(model_dir)), Llama3Config)
    axes = _mesh_axes(args.mesh, n_dev, "tensor" if llama else "expert")
    if math.prod(axes.values()) != n_dev:
        raise LaunchError(
            f"--mesh {args.mesh} needs {math.prod(axes.values())} devices, but the run has {n_dev} "
            f"({jax.process_count()} processes x {jax.local_device_count()} devices)"
        )
    mesh = mtp_jax.make_mesh(**axes)
    t0 = time.perf_counter()
    from mtp_jax.cli import check_draft_name, lora_load_kwargs, needs_draft_model

    check_draft_name(args.draft, LaunchError)
    if needs_draft_model(args.draft) and args.draft_model is None:
        raise LaunchError(f"--draft {args.draft} needs --draft-model DIR (the draft's directory)")
    model = mtp_jax.load(
        model_dir,
        args.dtype,
        mesh=mesh,
        draft_model=args.draft_model,
        draft_layer_ids=args.draft_layer_ids,
        window_cache=args.window_cache,
        **(lora_load_kwargs(args) if args.serve else {}),
    )
    load_s = time.perf_counter() - t0
    draft = args.draft
    if draft == "auto":
        draft = model.default_draft or "none"
    if args.serve:
        return _serve(args, model, model_dir, None if draft == "none" else draft, axes)
    prompts, tok = _prompts(args, model_dir)
    if not prompts:
        raise LaunchError("give --prompt TEXT or --prompt-ids 1,2,3")
    gen = {
        "temperature": args.temperature,
        "seed": args.seed,
        "draft": None if draft == "none" else draft,
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    where = {
        "processes": jax.process_count(),
        "devices": n_dev,
        "mesh": axes,
        "platform": jax.devices()[0].platform,
        "load_seconds": load_s,
    }
    if args.bench:
        from mtp_jax.bench import measure

        opts = argparse.Namespace(new_tokens=args.new_tokens, repeats=args.repeats)
        res = measure(prompts, opts, args.batch, [(model, gen)])[0]
        report = {**where, "decode_tok_s": res["decode_tok_s"], "stats": res["stats"]}
    else:
        result = model.generate(
            prompts, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, **gen
        )
        report = {
            **where,
            "tokens": result.tokens,
            "finish_reasons": result.finish_reasons,
            "stats": result.stats,
        }
    if lead:
        _print(report, args, tok)
    return 0


def _serve(args: argparse.Namespace, model, model_dir: str, draft: str | None, axes: dict) -> int:
    """Process 0 serves HTTP until interrupted and then closes the engine; the others replay its
    engine's steps until it does (they ignore SIGINT: process 0 tells them when to stop)."""
    import signal

    import jax

    from mtp_jax.cli import make_engine, server_kwargs

    engine = make_engine(args, model, draft)
    if jax.process_index() != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.wait()
        if engine.failed:
            _abandon(f"process {jax.process_index()}: the engine failed: {engine.failure}")
        return 0
    from mtp_jax.server import serve

    name = args.served_model_name or os.path.basename(os.path.abspath(model_dir))
    print(
        f"serving {name} on http://{args.host}:{args.port}/v1 ({jax.process_count()} processes, mesh {axes}; "
        f"{engine.slots} slots x {engine.max_len} tokens; speculation: {draft or 'none'}; pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve(engine, name, host=args.host, port=args.port, **server_kwargs(args))
    finally:
        if not engine.failed:
            engine.close()
    if engine.failed:
        _abandon(f"process 0: the engine failed: {engine.failure}")
    return 0


def _abandon(message: str) -> None:
    """Exit with status 1 now: another process of the run is gone (or the device failed), so the
    engine's thread may be stuck in a collective and JAX's own shutdown would wait for the lost
    process (minutes) before giving up."""
    print(f"launch: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _print(report: dict, args: argparse.Namespace, tok) -> None:
    if args.json:
        print(json.dumps(report), flush=True)
        return
    print(
        f"[{report['processes']} processes, {report['devices']} {report['platform']} devices, mesh "
        f"{report['mesh']}; loaded in {report['load_seconds']:.1f}s]",
        file=sys.stderr,
    )
    st = report["stats"]
    if "tokens" in report:
        for new in report["tokens"]:
            print(tok.decode(new, skip_special_tokens=True) if tok is not None else new)
    else:
        print(f"decode {report['decode_tok_s']:.1f} tok/s (median of {args.repeats})")
    print(
        f"[steps {st['steps']}, {st['new_tokens']} new tokens, acceptance length "
        f"{st['acceptance_length']:.2f}, decode {st['decode_tokens_per_second']:.1f} tok/s]",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from mtp_jax.cli import CliError
    from mtp_jax.errors import MtpJaxError

    try:
        if args.local:
            devices = args.devices_per_process
            if devices is None:
                total = math.prod(_mesh_axes(args.mesh, args.local).values())
                if total % args.local:
                    raise LaunchError(
                        f"--mesh {args.mesh} ({total} devices) does not split over {args.local}"
                    )
                devices = total // args.local
            command = [sys.executable, os.path.abspath(__file__), *_without_launcher_flags(argv)]
            return spawn_local(command, args.local, devices, timeout_s=args.timeout)
        return run(args)
    except (LaunchError, CliError, MtpJaxError, ValueError) as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
