"""Multi-host runs: which cluster this process belongs to, joining it, and N processes on one machine.

A multi-host run is one process per host (or per group of local devices), all running the same
program over one global mesh (``jax.distributed``). :func:`resolve_cluster` finds the coordinator,
the process count and this process's id from explicit values, then the ``JAX_*`` variables, then
SLURM's; :func:`initialize` joins. :func:`spawn_local` runs N such processes on localhost with
simulated CPU devices and gloo collectives: how the tests exercise the multi-host code paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LAUNCHER_PID = "MTP_JAX_LAUNCHER_PID"
DEFAULT_SLURM_PORT = 12345
_GLOO_CHATTER = ("[Gloo]", "peer ranks")
"""Marks of gloo's connection messages. Its threads write them concurrently, so a line can arrive
cut in two ("[Gloo] Rank 0 is connected to" / " 7 peer ranks. Expected ..."): match either part.
A cut after the message's last colon leaves its count alone on the next line ("... ranks is : " /
"7"): :func:`_relay` drops such a line only when a chatter line before it ended unfinished."""
_GLOO_TEMPLATE = "[Gloo] Rank N is connected to N peer ranks. Expected number of connected peer ranks is : N"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


class LaunchError(Exception):
    """A multi-host run could not be set up (bad cluster description, unreachable coordinator...)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits in a multi-process run. All None: let ``jax.distributed.initialize``
    detect everything itself (Cloud TPU VMs, Open MPI)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def auto(self) -> bool:
        return self.coordinator is None and self.num_processes is None and self.process_id is None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[003-007,9],gpu1`` -> ``node003``."""
    m = re.match(r"\s*([^,\[\s]+)(?:\[([^\],\-]+))?", nodelist)
    if not m or not m.group(1):
        raise LaunchError(f"cannot read a host name from the SLURM node list {nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def _int(value: str | int | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{what} must be an integer, got {value!r}") from None


def resolve_cluster(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    environ: Mapping[str, str] | None = None,
    slurm_port: int = DEFAULT_SLURM_PORT,
) -> Cluster | None:
    """The cluster of this process, or None for a plain single-process run.

    Each of the three values comes from the first source that has it: the arguments, then
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, then SLURM
    (``SLURM_NTASKS``, ``SLURM_PROCID``, and the first host of ``SLURM_STEP_NODELIST`` or
    ``SLURM_JOB_NODELIST`` with ``slurm_port``). ``auto`` with nothing found leaves detection to
    ``jax.distributed.initialize`` (Cloud TPU VMs). One process in total means no cluster.
    """
    env = os.environ if environ is None else environ
    n = num_processes if num_processes is not None else _int(env.get(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _int(env.get(ENV_PROCESS_ID), ENV_PROCESS_ID)
    coord = coordinator or env.get(ENV_COORDINATOR) or None
    if "SLURM_NTASKS" in env:
        n = n if n is not None else _int(env["SLURM_NTASKS"], "SLURM_NTASKS")
        pid = pid if pid is not None else _int(env.get("SLURM_PROCID"), "SLURM_PROCID")
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if coord is None and nodes and (n or 0) > 1:
            coord = f"{first_slurm_host(nodes)}:{slurm_port}"
    if coord is None and n is None and pid is None:
        return Cluster() if auto else None
    if n == 1 and pid in (None, 0):
        return None
    missing = [
        name
        for name, value in (("coordinator", coord), ("num_processes", n), ("process_id", pid))
        if value is None
    ]
    if missing:
        raise LaunchError(
            f"incomplete cluster description: {', '.join(missing)} not given (use --coordinator, "
            f"--num-processes, --process-id or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})"
        )
    if n < 1 or not 0 <= pid < n:
        raise LaunchError(f"process id {pid} is outside [0, {n}) for {n} processes")
    if not re.fullmatch(r"\[?[\w.\-:]+\]?:\d+", coord):
        raise LaunchError(f"coordinator must be host:port, got {coord!r}")
    return Cluster(coord, n, pid)


def initialize(cluster: Cluster, timeout_s: int = 300) -> None:
    """Join ``cluster`` (call before anything else touches JAX devices). On CPU the processes talk
    through gloo. Raises :class:`LaunchError` naming the coordinator when it cannot be reached
    within ``timeout_s`` (when the others never join, process 0 is aborted by JAX itself)."""
    import jax

    _exit_with_launcher()
    if not cluster.auto and cluster.process_id != 0:
        # JAX aborts the whole process (a C++ fatal error) when the coordinator stays unreachable;
        # checking first turns that into an error that says what is wrong.
        wait_for_coordinator(cluster.coordinator, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            cluster.coordinator,
            cluster.num_processes,
            cluster.process_id,
            initialization_timeout=timeout_s,
        )
    except Exception as e:  # jax raises XlaRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE ...)
        where = "auto-detected coordinator" if cluster.auto else f"coordinator {cluster.coordinator}"
        raise LaunchError(
            f"process {cluster.process_id} of {cluster.num_processes} could not join the run at the "
            f"{where} within {timeout_s}s: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until something accepts TCP connections at ``address`` (host:port), or raise
    :class:`LaunchError` after ``timeout_s``."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() + 0.25 > deadline:
                raise LaunchError(
                    f"the coordinator {address} was unreachable for {timeout_s:g}s ({e.strerror or e}); is "
                    "process 0 running, and is the address one that this host can reach?"
                ) from None
            time.sleep(0.25)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _exit_with_launcher() -> None:
    """In a process started by :func:`spawn_local`: exit as soon as the launcher is gone (even
    killed with SIGKILL), so that no process of the run is left behind. A thread polling the parent
    id, because a ``preexec_fn`` would fork a multithreaded (JAX) process."""
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if not launcher or not launcher.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def _is_chatter(line: str) -> bool:
    return any(mark in line for mark in _GLOO_CHATTER)


def _relay(src: IO[str], dst: IO[str]) -> None:
    unfinished = 0  # chatter messages whose closing count has not been seen yet
    for line in src:
        if _is_chatter(line):
            unfinished += line.count("ranks is :") - len(re.findall(r"ranks is : *\d+", line))
            continue
        fragment = re.sub(r"\d+", "N", line.strip())
        if unfinished > 0 and fragment and fragment in _GLOO_TEMPLATE:
            unfinished -= 1  # the rest of a cut message
            continue
        dst.write(line)
        dst.flush()


def spawn_local(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int = 1,
    *,
    timeout_s: float = 600,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``command`` as ``num_processes`` processes of one run on localhost and wait for them.

    Each process gets the coordinator (a free local port), the process count and its id through
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, and
    ``devices_per_process`` simulated CPU devices. Process 0's output goes to ``stdout``/``stderr``
    (default: ours) without gloo's connection chatter; the others' is kept and shown only if they
    fail. When one fails, or ``timeout_s`` passes, the rest are killed; processes that call
    :func:`initialize` also exit by themselves if the launcher dies. Returns 0, the first non-zero
    exit status, or 124 on timeout.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise LaunchError("need at least one process and one device per process")
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    base = dict(os.environ if env is None else env)
    base.update(
        {
            ENV_COORDINATOR: f"localhost:{free_port()}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_LAUNCHER_PID: str(os.getpid()),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(
                [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
                + [f"{_DEVICE_COUNT_FLAG}={devices_per_process}"]
            ),
        }
    )
    procs: list[subprocess.Popen] = []
    logs: list[IO[str] | None] = []
    relays: list[threading.Thread] = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(_kill, procs)
        for i in range(num_processes):
            child_env = dict(base, **{ENV_PROCESS_ID: str(i)})
            log = None if i == 0 else cleanup.enter_context(tempfile.TemporaryFile("w+"))
            p = subprocess.Popen(
                list(command),
                env=child_env,
                stdout=subprocess.PIPE if log is None else log,
                stderr=subprocess.PIPE if log is None else subprocess.STDOUT,
                text=True,
            )
            if log is None:
                relays += [
                    threading.Thread(target=_relay, args=(p.stdout, stdout), daemon=True),
                    threading.Thread(target=_relay, args=(p.stderr, stderr), daemon=True),
                ]
                for t in relays:
                    t.start()
            procs.append(p)
            logs.append(log)
        return _wait_all(procs, logs, relays, timeout_s, stderr)


def _wait_all(
    procs: list[subprocess.Popen],
    logs: list[IO[str] | None],
    relays: list[threading.Thread],
    timeout_s: float,
    stderr: IO[str],
) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None or all(c == 0 for c in codes):
            break
        if time.monotonic() > deadline:
            _kill(procs)
            stderr.write(f"launch: timed out after {timeout_s:.0f}s; stopped all {len(procs)} processes\n")
            return 124
        time.sleep(0.05)
    if failed is not None:
        _kill(procs)
    for t in relays:
        t.join(timeout=5)
    if failed is None:
        return 0
    log = logs[failed]
    if log is not None:
        log.seek(0)
        lines = [line for line in log.read().splitlines() if not _is_chatter(line)]
        stderr.write(f"--- process {failed} (last lines) ---\n" + "\n".join(lines[-40:]) + "\n")
    stderr.write(f"launch: process {failed} exited with status {codes[failed]}; stopped the others\n")
    return codes[failed] or 1


def _kill(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Terminate the processes still running, then kill those that ignore it."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _StreamNames:
    """Names for this process's broadcast streams: ``kind/n``, n counting the streams of that kind
    opened so far. Every process opens its streams in the same order (each makes the same
    engines), so the names agree across processes without a message. The one piece of process-wide
    state serving keeps: a numbering, under a lock (engines in several threads stay distinct)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened: dict[str, int] = {}

    def __call__(self, kind: str) -> str:
        with self._lock:
            n = self._opened.get(kind, 0)
            self._opened[kind] = n + 1
        return f"{kind}/{n}"


stream_name = _StreamNames()
"""``stream_name(kind) -> "kind/n"``: the next broadcast stream name of that kind."""


PEER_TIMEOUT_S = 10.0
"""How long (seconds) a process of a multi-process run may go unheard before :class:`Heartbeat`
counts it as lost, unless the engine is told otherwise (``Engine(peer_timeout_s=...)``)."""


class PeerLostError(RuntimeError):
    """Another process of a multi-process run stopped answering (died, or its host did)."""


class Heartbeat:
    """Liveness of a run's other processes, beside its collectives: every ``interval_s`` each
    process counts up a key of its own in the coordinator's key-value store and reads the others'.
    ``on_lost(error)`` (a :class:`PeerLostError`) is called once, from the heartbeat's thread, when a
    process that has been heard from stops counting for ``timeout_s``, or when the store itself
    (hosted by process 0) cannot be reached. A collective with a lost peer may fail at once (gloo)
    or wait forever (NCCL), and JAX's coordination service aborts the survivors only after its own
    heartbeat timeout (100 s): this lets a server end its requests with an error, and exit, first.
    A process not heard from yet (still loading) is not timed. ``name`` as for :class:`Broadcast`."""

    def __init__(
        self, name: str, on_lost, interval_s: float = 1.0, timeout_s: float = PEER_TIMEOUT_S
    ) -> None:
        import jax
        from jax._src import distributed

        self.client = distributed.global_state.client
        if self.client is None or jax.process_count() < 2:
            raise LaunchError("a heartbeat needs a multi-process run (jax.distributed.initialize first)")
        self.name, self.me, self.count = name, jax.process_index(), jax.process_count()
        self.on_lost, self.interval_s, self.timeout_s = on_lost, interval_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtp-jax-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        heard: dict[int, tuple[str, float]] = {}  # process -> (its last count, when it changed)
        beat = 0
        while not self._stop.wait(self.interval_s):
            beat += 1
            try:
                self.client.key_value_set(f"{self.name}/{self.me}", str(beat), allow_overwrite=True)
                now = time.monotonic()
                for p in range(self.count):
                    if p == self.me:
                        continue
                    try:
                        value = self.client.key_value_try_get(f"{self.name}/{p}")
                    except Exception as e:  # NOT_FOUND: not started yet
                        if "NOT_FOUND" not in str(e).upper():
                            raise
                        continue
                    last = heard.get(p)
                    if last is None or last[0] != value:
                        heard[p] = (value, now)
                    elif now - last[1] > self.timeout_s:
                        self._lost(f"process {p} of the run has not been heard from for {self.timeout_s:g}s")
                        return
            except Exception as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._lost(f"the run's coordinator (process 0) cannot be reached: {first}")
                return

    def _lost(self, message: str) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self.on_lost(PeerLostError(message))

    def stop(self) -> None:
        self._stop.set()


class Broadcast:
    """An ordered stream of small messages from process 0 to every other process of a run, over
    the coordinator's key-value store (no device collective: a follower may wait for hours while
    process 0 is idle). ``name`` keeps separate streams apart; every process must create the same
    streams in the same order. Message ``n`` lives at ``<name>/<n // GROUP>/<n % GROUP>``; process 0
    deletes a group once every follower has acknowledged reading past it."""

    GROUP = 256

    def __init__(self, name: str) -> None:
        import jax
        from jax._src import distributed  # the client jax.distributed.initialize made

        self.client = distributed.global_state.client
        if self.client is None or jax.process_count() < 2:
            raise LaunchError("a broadcast needs a multi-process run (jax.distributed.initialize first)")
        self.name, self.me, self.count = name, jax.process_index(), jax.process_count()
        self.sent = self.received = 0
        self._dropped = 0  # groups deleted so far

    def _key(self, n: int) -> str:
        return f"{self.name}/{n // self.GROUP}/{n % self.GROUP}"

    def send(self, message: str) -> None:
        """(Process 0.) Publish the next message."""
        self.client.key_value_set(self._key(self.sent), message)
        self.sent += 1
        if self.sent % self.GROUP == 0:
            self._collect()

    def _collect(self) -> None:
        read = []
        for p in range(1, self.count):
            try:
                read.append(int(self.client.key_value_try_get(f"{self.name}/ack/{p}")))
            except Exception:  # NOT_FOUND: that follower has not finished a group yet
                read.append(0)
        done = min(read) // self.GROUP  # groups every follower has finished
        while self._dropped < done:
            self.client.key_value_delete(f"{self.name}/{self._dropped}")  # the group's directory
            self._dropped += 1

    def receive(self, poll_s: float = 60.0) -> str:
        """(Other processes.) The next message, waiting as long as it takes."""
        key = self._key(self.received)
        while True:
            try:
                value = self.client.blocking_key_value_get(key, int(poll_s * 1000))
                break
            except Exception as e:  # DEADLINE_EXCEEDED: process 0 is idle; anything else is fatal
                if "DEADLINE" not in str(e).upper():
                    raise
        self.received += 1
        if self.received % self.GROUP == 0:
            self.client.key_value_set(f"{self.name}/ack/{self.me}", str(self.received), allow_overwrite=True)
        return value
