"""Multi-host runs on one machine: scripts/launch.py --local N (processes on localhost with simulated
CPU devices and gloo collectives), per-host sharded loading, cluster discovery and error paths."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mtp_jax.distributed import (
    Cluster,
    LaunchError,
    _relay,
    first_slurm_host,
    free_port,
    resolve_cluster,
    spawn_local,
)
from tests.conftest import EMBEDDED_MODEL, REPO, require_extra

LAUNCH = os.path.join(REPO, "scripts", "launch.py")
ENV = dict(os.environ, PYTHONPATH=REPO)


def _launch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, LAUNCH, *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


@pytest.mark.spawns
@pytest.mark.slow
def test_two_processes_generate_the_tokens_of_one():
    """Rows and pages split over data x expert (half the rows per process), experts over expert: greedy MTP
    decoding with K = 3 gives exactly the single-process tokens, printed by process 0 only."""
    import mtp_jax

    prompts = ["import os", "def main():"]
    out = _launch(
        "--local", "2", "--mesh", "data=2,expert=4", *(f"--prompt={p}" for p in prompts),
        "-k", "3", "--max-new-tokens", "12", "--ignore-eos", "--json", "--timeout", "500",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout  # process 1 is silent
    got = json.loads(lines[0])
    assert got["processes"] == 2 and got["devices"] == 8 and got["mesh"] == {"data": 2, "expert": 4}
    assert got["stats"]["steps"] < 2 * 12 and got["stats"]["acceptance_length"] > 1

    from mtp_jax.cli import _encode, _tokenizer

    model = mtp_jax.load(EMBEDDED_MODEL, "float32")
    tok = _tokenizer(EMBEDDED_MODEL)
    ids = [_encode(tok, p) for p in prompts]
    want = model.generate(ids, max_new_tokens=12, ignore_eos=True, draft="mtp", num_speculative_tokens=3)
    assert got["tokens"] == want.tokens


@pytest.mark.spawns
@pytest.mark.slow
def test_two_processes_run_a_tensor_parallel_llama_like_one():
    """Llama with a separately trained EAGLE-3 draft (--draft-model) over 2 processes x 4 devices,
    rows over data and heads over tensor: the tokens of one process, sampled ones included."""
    import mtp_jax

    model_dir = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib")
    draft_dir = os.path.join(REPO, "checkpoints", "tiny-llama3-stdlib-eagle3")
    prompts = [[0, 485, 289, 857, 878], [0, 35, 89, 79]]
    out = _launch(
        "--local", "2", "--mesh", "data=4,tensor=2", "--model", model_dir, "--draft-model", draft_dir,
        *(f"--prompt-ids={','.join(map(str, p))}" for p in prompts), "--temperature", "0.8", "--seed", "4",
        "-k", "3", "--max-new-tokens", "10", "--ignore-eos", "--json", "--timeout", "500",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["mesh"] == {"data": 4, "tensor": 2} and got["stats"]["num_speculative_tokens"] == 3
    want = mtp_jax.load(model_dir, "float32", draft_model=draft_dir).generate(
        prompts,
        max_new_tokens=10,
        ignore_eos=True,
        temperature=0.8,
        seed=4,
        draft="eagle3",
        num_speculative_tokens=3,
    )
    assert got["tokens"] == want.tokens


@pytest.mark.spawns
@pytest.mark.slow
def test_two_processes_keep_gemmas_window_in_rings_like_one_device():
    """--window-cache ring over 2 processes x 2 devices (rows and their rings over data, heads over
    tensor): a prompt that goes round the ring (150 tokens, rings of 96 positions) decodes as one
    process with every page does."""
    import mtp_jax

    model_dir = os.path.join(REPO, "tests", "fixtures", "parity_gemma3", "pattern6_tied")
    prompts = [[int(x) for x in np.random.default_rng(1).integers(1, 120, n)] for n in (150, 40)]
    out = _launch(
        "--local", "2", "--mesh", "data=2,tensor=2", "--model", model_dir, "--window-cache", "ring",
        *(f"--prompt-ids={','.join(map(str, p))}" for p in prompts), "--draft", "none",
        "--max-new-tokens", "12", "--ignore-eos", "--json", "--timeout", "500",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = mtp_jax.load(model_dir, "float32").generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert got["tokens"] == want.tokens


@pytest.mark.spawns
@pytest.mark.slow
def test_two_processes_serve_what_one_generates(tmp_path):
    """--serve over 2 processes: process 0 serves HTTP, process 1 replays its engine's steps;
    concurrent greedy requests (one client hanging up mid-stream) get offline generate's text, the
    pages all come back; a LoRA adapter loaded at run time (both processes) serves offline
    generate's text with it; a request sharing another's first pages hits the prefix cache (the
    same choices on both processes) and answers the same, prompts arriving in chunks of 16 tokens
    (chunked prefill over the data axis); and a SIGTERM to process 0 while a
    request streams lets that request finish (drain), refuses new connections, and stops both
    cleanly."""
    httpx = require_extra("httpx")
    require_extra("uvicorn")
    import signal
    import threading

    import mtp_jax

    proc = subprocess.Popen(
        [sys.executable, LAUNCH, "--local", "2", "--mesh", "data=2,expert=4", "--serve", "--port", "0",
         "--slots", "2", "--max-len", "64", "--warmup", "none", "--timeout", "500", "--max-loras", "1",
         "--allow-runtime-lora-updating", "--chunked-prefill-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        base = _listening(lines, [proc], 400)
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        prompts = ["import os", "def main():", "class A:"]
        texts: dict[int, str] = {}

        def complete(i: int) -> None:
            body = {"prompt": prompts[i], "max_tokens": 16, "temperature": 0}
            r = httpx.post(base + "/v1/completions", json=body, timeout=300)
            texts[i] = r.json()["choices"][0]["text"]

        def hang_up() -> None:
            body = {"prompt": "import sys", "max_tokens": 40, "temperature": 0, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                        return

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(3)]
        threads.append(threading.Thread(target=hang_up))
        for t in threads:
            t.start()
        for t in threads:
            t.join(400)
        model = mtp_jax.load(EMBEDDED_MODEL, "float32", max_loras=1)
        want = model.generate(prompts, max_new_tokens=16, draft="mtp", num_speculative_tokens=3).texts
        assert [texts.get(i) for i in range(3)] == want
        # an adapter loaded while serving: process 1 loads it into the same slot before the next step
        from tests.test_lora import write_random_adapter

        adapter = write_random_adapter(tmp_path / "a", model, 4, ["kv_b_proj", "o_proj", "up_proj"], seed=3)
        r = httpx.post(
            base + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter}, timeout=60
        )
        assert r.status_code == 200, r.text
        # 8 rows: the engine's 8 slots (rows split over data x expert), 4 on each process's devices
        body = {"model": "a", "prompt": prompts[0], "max_tokens": 16, "temperature": 0, "n": 8}
        got = httpx.post(base + "/v1/completions", json=body, timeout=300).json()["choices"]
        model.load_lora("a", adapter)
        kw = dict(max_new_tokens=16, draft="mtp", num_speculative_tokens=3, lora="a")
        adapted = model.generate(prompts[:1], **kw).texts[0]
        assert [c["text"] for c in got] == [adapted] * 8 and adapted != want[0]
        # log-probabilities: the step's program with them runs on both processes, and a prompt is
        # scored by both (process 1 replays it instead of a step)
        body = {"prompt": prompts[1], "max_tokens": 8, "temperature": 0, "logprobs": 2, "n": 8}
        got = httpx.post(base + "/v1/completions", json=body, timeout=300).json()["choices"]
        off = model.generate(prompts[1:2], max_new_tokens=8, logprobs=2).logprobs[0]
        for c in got:
            assert c["logprobs"]["token_logprobs"] == pytest.approx([e.logprob for e in off], abs=2e-5)
        body = {"prompt": prompts[1], "max_tokens": 0, "echo": True, "logprobs": 1}
        scored = httpx.post(base + "/v1/completions", json=body, timeout=300).json()["choices"][0]["logprobs"]
        want_scores = [e.logprob for e in model.prompt_logprobs(prompts[1], 1)[1:]]
        assert scored["token_logprobs"][0] is None
        assert scored["token_logprobs"][1:] == pytest.approx(want_scores, abs=2e-5)
        # prefix caching: both processes make the same cache choices (a later request sharing the
        # first pages prefills only the rest) and it answers what offline generate does; prompts
        # longer than 16 tokens arrive in chunks, each chunk's row on its own data shard
        head = "import os\nimport sys\nimport json\nimport time\nimport math\nimport re\nimport random\n"
        shared = [head + "import shutil\n", head + "def main():\n"]
        got = []
        for prompt in shared:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
            r = httpx.post(base + "/v1/completions", json=body, timeout=300)
            got.append(r.json()["choices"][0]["text"])
        kw = dict(max_new_tokens=8, draft="mtp", num_speculative_tokens=3)
        assert got == [model.generate([p], **kw).texts[0] for p in shared]
        metrics = httpx.get(base + "/metrics", timeout=30).text
        hits = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:prefix_cache_hits_total"))
        assert float(hits.rsplit(" ", 1)[1]) >= 16, hits
        usage = None
        for _ in range(100):  # the hung-up request is cancelled within a step or two
            metrics = httpx.get(base + "/metrics", timeout=30).text
            usage = [ln for ln in metrics.splitlines() if ln.startswith("vllm:kv_cache_usage_perc")]
            if usage and float(usage[0].rsplit(" ", 1)[1]) == 0:
                break
            time.sleep(0.1)
        assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0, usage
        assert 'finished_reason="abort"' in metrics
        pid = next(int(ln.rsplit("pid ", 1)[1].rstrip(")\n")) for ln in lines if ln.startswith("serving "))
        pieces: list[dict] = []
        started = threading.Event()

        def drained() -> None:  # streams while SIGTERM arrives: it must still get every token
            body = {
                "prompt": prompts[2],
                "max_tokens": 40,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0])
                        started.set()

        streaming = threading.Thread(target=drained)
        streaming.start()
        assert started.wait(120)
        os.kill(pid, signal.SIGTERM)
        streaming.join(300)
        assert pieces[-1]["finish_reason"] == "length", pieces[-3:]
        off = model.generate(
            [prompts[2]], max_new_tokens=40, ignore_eos=True, draft="mtp", num_speculative_tokens=3
        )
        assert "".join(p["text"] for p in pieces) == off.texts[0]
        assert proc.wait(120) == 0, "".join(lines)[-4000:]
        with pytest.raises(httpx.TransportError):  # nothing listens any more
            httpx.get(base + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()


def _listening(lines: list[str], procs: list[subprocess.Popen], seconds: float) -> str:
    """The base URL of a server started with ``--port 0``, from the 'listening on' line its process
    writes once it accepts connections (``lines``: its output, read by another thread)."""
    deadline = time.monotonic() + seconds
    while True:
        found = [line for line in list(lines) if line.startswith("listening on http://")]
        if found:
            return found[0].split()[2].removesuffix("/v1")
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.2)


def _serving_pair() -> list[subprocess.Popen]:
    """Two processes of one serving run started by hand, as on two hosts (no local launcher to
    stop the survivor): process 0 serves HTTP on a port it picks (``--port 0``); stdout and stderr
    merged."""
    coordinator = f"localhost:{free_port()}"
    flags = f"{ENV.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"  # the tests' own too
    env = dict(ENV, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    return [
        subprocess.Popen(
            [
                sys.executable,
                LAUNCH,
                "--coordinator",
                coordinator,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--mesh",
                "data=2,expert=4",
                "--serve",
                "--port",
                "0",
                "--slots",
                "2",
                "--max-len",
                "64",
                "--warmup",
                "none",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )  # fmt: skip
        for i in (0, 1)
    ]


@pytest.mark.spawns
@pytest.mark.slow
def test_a_lost_process_ends_the_requests_and_stops_the_other():
    """Two processes serving, each killed in turn mid-stream (SIGKILL, as a crash or a lost host):
    when process 1 goes, process 0 ends the stream with an error event (then [DONE], not a cut
    connection) and exits with status 1 within seconds, not at JAX's 100 s heartbeat; when process
    0 goes, process 1 exits non-zero as quickly."""
    httpx = require_extra("httpx")
    require_extra("uvicorn")
    import signal
    import threading

    for victim in (1, 0):
        procs = _serving_pair()
        logs: list[list[str]] = [[], []]
        for i, p in enumerate(procs):
            threading.Thread(target=lambda out=logs[i], p=p: out.extend(p.stdout), daemon=True).start()
        try:
            base = _listening(logs[0], procs, 300)
            assert httpx.get(base + "/health", timeout=30).status_code == 200
            lines: list[str] = []

            def stream(lines=lines, base=base) -> None:
                body = {
                    "prompt": "import os",
                    "max_tokens": 48,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                }
                try:
                    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                        lines.extend(ln for ln in r.iter_lines() if ln)
                except httpx.HTTPError as e:
                    lines.append(f"cut: {e}")

            reader = threading.Thread(target=stream)
            reader.start()
            while not any(ln.startswith("data: {") for ln in lines):
                assert reader.is_alive(), lines
                time.sleep(0.02)
            procs[victim].send_signal(signal.SIGKILL)
            survivor = procs[1 - victim]
            # JAX's heartbeat would stop it only after 100 s: a survivor left to that raises here
            rc = survivor.wait(90)
            reader.join(60)
            assert rc != 0, rc
            if victim == 1:
                assert rc == 1, "".join(logs[0])[-3000:]
                assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-3:]
                assert "the engine failed" in lines[-2] and "the engine failed" in "".join(logs[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


@pytest.mark.spawns
def test_bench_mode_times_decoding():
    """--bench: a compiling run, then timed ones; one process is enough to run the same code."""
    model_dir = os.path.join(REPO, "tests", "fixtures", "parity_llama", "mha_fp16")
    out = _launch(
        "--model", model_dir, "--prompt-ids=3,14,15", "--prompt-ids=9,2", "--bench", "--batch", "2",
        "--new-tokens", "5", "--repeats", "2", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["decode_tok_s"] > 0 and got["stats"]["new_tokens"] == 10 and got["stats"]["batch"] == 2


# Each of 2 processes (4 devices each) on mesh data=1, expert=8 holds experts 4p..4p+3: it must read
# only those from the safetensors, and the shards it holds must equal a plain load's, for the hub
# checkpoint and for the orbax one (restored straight into the target sharding). Teacher-forced
# logits and hidden states of rows split across the processes come back whole on each.
PER_HOST_CHILD = textwrap.dedent(
    """
    import re, sys
    from mtp_jax.distributed import initialize, resolve_cluster
    initialize(resolve_cluster(), 120)
    import jax, numpy as np
    import mtp_jax
    from mtp_jax.checkpoint.safetensors_io import CheckpointReader

    read = []
    real = CheckpointReader.get
    def get(self, key):
        read.append(key)
        return real(self, key)
    CheckpointReader.get = get

    hub, converted = sys.argv[1:3]
    me = jax.process_index()
    mesh = mtp_jax.make_mesh(data=1, expert=8)
    sharded = mtp_jax.load(hub, "float32", mesh=mesh)
    experts = {int(m.group(1)) for k in read if (m := re.search(r"\\.mlp\\.experts\\.(\\d+)\\.", k))}
    assert experts == set(range(4 * me, 4 * me + 4)), (me, experts)
    assert "model.embed_tokens.weight" in read
    plain_model = mtp_jax.load(hub, "float32")
    plain = jax.tree.leaves(plain_model.params)
    restored = mtp_jax.load(converted, "float32", mesh=mesh)
    for model in (sharded, restored):
        leaves = jax.tree.leaves(model.params)
        assert len(leaves) == len(plain)
        for got, want in zip(leaves, plain):
            assert got.shape == want.shape and not got.is_fully_addressable
            for shard in got.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])
    gate = sharded.params["moe"]["mlp"]["gate"]
    assert {s.data.shape[1] for s in gate.addressable_shards} == {1}
    # 8 rows are split over the devices of both processes; every process reads the whole result
    ids = [[(31 * i + 7 * j) % 2000 + 5 for j in range(6)] for i in range(8)]
    np.testing.assert_allclose(sharded.logits(ids), plain_model.logits(ids), rtol=1e-5, atol=1e-5)
    got, want = sharded.hidden_states(ids, [1]), plain_model.hidden_states(ids, [1])
    np.testing.assert_allclose(got.layers, want.layers, rtol=1e-5, atol=1e-5)
    print("PER-HOST-OK", me, flush=True)
    """
)


@pytest.mark.spawns
def test_each_process_reads_only_its_experts(tmp_path):
    from mtp_jax.checkpoint.convert import convert

    converted = str(tmp_path / "orbax")
    convert(EMBEDDED_MODEL, converted, weights="fp32", progress=False)
    stdout, stderr = io.StringIO(), io.StringIO()
    rc = spawn_local(
        [sys.executable, "-c", PER_HOST_CHILD, EMBEDDED_MODEL, converted],
        2,
        4,
        timeout_s=400,
        env=ENV,
        stdout=stdout,
        stderr=stderr,
    )
    assert rc == 0, stderr.getvalue()[-4000:]
    assert "PER-HOST-OK 0" in stdout.getvalue()
    assert "[Gloo]" not in stderr.getvalue()


# Process 0 streams messages to process 1 over the coordinator's key-value store; groups every
# follower has read are deleted. An engine made on every process: the follower refuses requests, a
# stop_check callable is refused on process 0 (it cannot be replayed), the follower replays process
# 0's warm-up, and closing process 0's engine ends the follower's.
BROADCAST_CHILD = textwrap.dedent(
    """
    import sys
    from mtp_jax.distributed import Broadcast, initialize, resolve_cluster
    initialize(resolve_cluster(), 120)
    import time
    import jax, pytest
    import mtp_jax

    lead = jax.process_index() == 0
    b = Broadcast("test")
    b.GROUP = 4
    if lead:
        for i in range(10):
            b.send(f"m{i}")
    else:
        assert [b.receive(poll_s=0.5) for _ in range(10)] == [f"m{i}" for i in range(10)]
    from mtp_jax.step import prefill, step

    engine = mtp_jax.Engine(mtp_jax.load(sys.argv[1], "float32"), slots=1, max_len=16)
    if lead:
        with pytest.raises(mtp_jax.InvalidRequestError, match="cannot be replayed"):
            engine.submit([1, 2], stop_check=lambda t: False)
        assert engine.warmup() == 3  # one admission size and prompt bucket, one step, one release
        quiet = mtp_jax.Engine(engine.model, slots=1, max_len=32)
        assert quiet.warmup(background=True) == 4  # compiled while idle, job by job
        while quiet.stats()["warmup_left"]:
            time.sleep(0.05)
        quiet.close()
        b.send(f"{prefill._cache_size()} {step._cache_size()}")
        b._collect()  # the follower acknowledged groups 0 and 1 (messages 0..7)
        assert b._dropped == 2
        with pytest.raises(Exception, match="NOT_FOUND"):
            b.client.key_value_try_get("test/0/1")
        engine.close()
        print("BROADCAST-OK", flush=True)
    else:
        with pytest.raises(mtp_jax.InvalidRequestError, match="process 0's engine takes requests"):
            engine.submit([1, 2])
        with pytest.raises(mtp_jax.InvalidRequestError, match="process 0's engine warms up"):
            engine.warmup()
        sizes = b.receive()
        quiet = mtp_jax.Engine(engine.model, slots=1, max_len=32)
        assert engine.wait(120) and quiet.wait(120) and not engine.failed and not quiet.failed
        # it followed process 0's warm-ups, both kinds: the same programs compiled
        assert f"{prefill._cache_size()} {step._cache_size()}" == sizes
    """
)


@pytest.mark.spawns
def test_broadcast_and_follower_engines():
    stdout, stderr = io.StringIO(), io.StringIO()
    rc = spawn_local(
        [sys.executable, "-c", BROADCAST_CHILD, EMBEDDED_MODEL], 2, 1, timeout_s=300, env=ENV,
        stdout=stdout, stderr=stderr,
    )  # fmt: skip
    assert rc == 0, stderr.getvalue()[-4000:]
    assert "BROADCAST-OK" in stdout.getvalue()


def test_gloo_chatter_is_dropped_even_when_its_lines_arrive_cut():
    """Gloo's threads write concurrently: a message can arrive split over two lines (seen in CI)."""
    src = io.StringIO(
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
        "[Gloo] Rank 1\n"
        " is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
        '{"tokens": [[1, 2]]}\n'
    )
    dst = io.StringIO()
    _relay(src, dst)
    assert dst.getvalue() == '{"tokens": [[1, 2]]}\n'
    # cut after the last colon, the count alone on its own line (seen in a full local run), also
    # with another thread's whole message in between; a number the program prints stays
    cut = "[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : "
    whole = "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"
    for lines in ([cut, "7", "7", "8"], [cut + whole, "7", "7", "8"]):
        dst = io.StringIO()
        _relay(io.StringIO("\n".join(lines) + "\n"), dst)
        assert dst.getvalue() == "7\n8\n", lines


# --- cluster discovery -------------------------------------------------------------------------------


def test_cluster_from_flags_then_jax_variables():
    env = {"JAX_COORDINATOR_ADDRESS": "h0:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert resolve_cluster(environ=env) == Cluster("h0:99", 4, 3)
    assert resolve_cluster("h1:5", 2, 1, environ=env) == Cluster("h1:5", 2, 1)
    assert resolve_cluster(environ={}) is None
    assert resolve_cluster(auto=True, environ={}) == Cluster()
    assert resolve_cluster("h:1", 1, 0, environ={}) is None  # one process: nothing to join


def test_cluster_from_slurm():
    env = {
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_STEP_NODELIST": "gpu[007-010],login1",
        "SLURM_JOB_NODELIST": "other",
    }
    assert resolve_cluster(environ=env, slurm_port=4321) == Cluster("gpu007:4321", 4, 2)
    assert resolve_cluster("me:1", environ=env) == Cluster("me:1", 4, 2)
    job_only = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "a1,a2"}
    assert resolve_cluster(environ=job_only) == Cluster("a1:12345", 2, 0)
    assert resolve_cluster(environ={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node001", "node001"), ("node001,host2", "node001"), ("node[001-0015],h", "node001"),
     ("node[003,007-015]", "node003"), ("a-b.c[9]", "a-b.c9")],
)  # fmt: skip
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coordinator": "h:1", "num_processes": 2}, "process_id not given"),
        ({"num_processes": 2, "process_id": 0}, "coordinator not given"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, r"outside \[0, 2\)"),
        ({"coordinator": "nohost", "num_processes": 2, "process_id": 0}, "host:port"),
        ({"environ": {"JAX_NUM_PROCESSES": "two"}}, "JAX_NUM_PROCESSES must be an integer"),
    ],
)
def test_bad_cluster_descriptions(kwargs, message):
    kwargs.setdefault("environ", {})
    with pytest.raises(LaunchError, match=message):
        resolve_cluster(**kwargs)


# --- error paths ------------------------------------------------------------------------------------


@pytest.mark.spawns
def test_unreachable_coordinator_is_a_clear_error():
    # a port this test holds bound and never listens on: refused, whatever else runs on the machine
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        out = _launch(
            "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", "1",
            "--init-timeout", "2", "--prompt-ids", "1,2",
        )  # fmt: skip
    assert out.returncode == 2
    assert "coordinator localhost:" in out.stderr and "unreachable for 2s" in out.stderr


@pytest.mark.spawns
def test_mesh_must_cover_every_device():
    out = _launch("--mesh", "data=1,expert=2", "--prompt-ids", "1,2")
    assert out.returncode == 2
    assert "needs 2 devices, but the run has 1" in out.stderr


@pytest.mark.spawns
def test_a_failing_process_stops_the_others():
    # only process 1 fails (after 3 s, so that process 0 has printed its line even on a loaded
    # machine); the others would sleep for an hour, so the launcher returning 3 at all (its own
    # timeout would say otherwise) shows it stopped them, and which failure is reported is certain
    code = "import os, sys, time; pid = int(os.environ['JAX_PROCESS_ID']); print('hi', pid, flush=True); time.sleep(3 if pid == 1 else 3600); sys.exit(3)"  # noqa: E501
    stdout, stderr = io.StringIO(), io.StringIO()
    rc = spawn_local([sys.executable, "-c", code], 3, timeout_s=120, stdout=stdout, stderr=stderr)
    assert rc == 3
    assert stdout.getvalue() == "hi 0\n"  # the others' output is shown only when they fail
    assert "--- process 1 (last lines) ---\nhi 1" in stderr.getvalue()
    assert "process 1 exited with status 3; stopped the others" in stderr.getvalue()


@pytest.mark.spawns
def test_the_launch_times_out():
    stderr = io.StringIO()
    rc = spawn_local(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        2,
        timeout_s=1,
        stdout=io.StringIO(),
        stderr=stderr,
    )
    assert rc == 124 and "timed out after 1s" in stderr.getvalue()


def test_local_mode_passes_everything_but_its_own_flags():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        from launch import _without_launcher_flags
    finally:
        sys.path.pop(0)
    argv = [
        "--local",
        "2",
        "--mesh",
        "data=1,expert=8",
        "--timeout=9",
        "--devices-per-process",
        "4",
        "-k",
        "3",
    ]
    assert _without_launcher_flags(argv) == ["--mesh", "data=1,expert=8", "-k", "3"]


@pytest.mark.spawns
def test_processes_exit_when_the_launcher_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    child = (
        "import os, time; from mtp_jax.distributed import _exit_with_launcher; _exit_with_launcher(); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    launcher = (
        "import sys; from mtp_jax.distributed import spawn_local; "
        f"spawn_local([sys.executable, '-c', {child!r}], 1, timeout_s=120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], env=ENV)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.1)
    parent.kill()  # SIGKILL: no clean-up code runs in the launcher
    parent.wait()
    pid = int(pid_file.read_text())
    while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid):
        assert time.monotonic() < deadline, "the child outlived its launcher"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_peer_timeout_flag_reaches_the_heartbeat(monkeypatch):
    """``--peer-timeout S`` (scripts/launch.py --serve) becomes the engine's ``peer_timeout_s`` and
    the heartbeat's timeout; a value that is not a positive number of seconds is refused by name."""
    import argparse

    from mtp_jax import InvalidRequestError
    from mtp_jax.cli import make_engine
    from mtp_jax.serving import Engine, replay
    from tests.scripts.test_train_tiny import import_script

    args = import_script(LAUNCH).build_parser().parse_args(["--serve", "--peer-timeout", "2.5"])
    assert args.peer_timeout == 2.5
    seen = {}

    def fake_engine(model, **kw):
        seen.update(kw)
        return argparse.Namespace(leader=False)

    monkeypatch.setattr("mtp_jax.serving.Engine", fake_engine)
    make_engine(args, None, None)
    assert seen["peer_timeout_s"] == 2.5
    monkeypatch.undo()

    beats = []
    monkeypatch.setattr(replay, "Heartbeat", lambda name, lost, timeout_s: beats.append(timeout_s))
    watcher = replay.Replay()
    watcher.channel = object()  # as in a multi-process run
    watcher.watch(None, 2.5)
    assert beats == [2.5]
    for bad in (0, -1.0, float("inf"), float("nan"), True, "10"):
        with pytest.raises(InvalidRequestError, match="peer_timeout_s must be a positive number"):
            Engine(None, peer_timeout_s=bad)
