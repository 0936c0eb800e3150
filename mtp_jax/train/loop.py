"""The resumable training loop shared by every training script: AdamW with warm-up and cosine
decay (:func:`make_optimizer`), each step's batch (:func:`training_window`), orbax saves and
resumption, and a one-line progress display with a recent-rate ETA (:class:`Meter`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from mtp_jax.train.data import batch_at


def decay_mask(params: dict) -> dict:
    """Weight decay on projections, embeddings and routers; never on norms or correction biases."""

    def keep(path, _) -> bool:
        name = str(path[-1].key)
        return not (name.endswith("norm") or name == "bias")

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(args: argparse.Namespace, params: dict) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup, max(args.steps - 1, 1)), max(args.steps, 2), args.lr * 0.1
    )
    frozen = jax.tree_util.tree_map_with_path(lambda p, _: str(p[-1].key) == "bias", params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask(params)),
        optax.masked(optax.set_to_zero(), frozen),  # correction biases move only by balance_bias
    )


@dataclasses.dataclass
class Meter:
    """A one-line progress display: step, loss, the draft's loss and agreement, tokens/s, ETA."""

    total: int
    tokens_per_step: int
    start: float = dataclasses.field(default_factory=time.perf_counter)
    first_step: int = 0
    tty: bool = dataclasses.field(default_factory=lambda: sys.stderr.isatty())
    last: float = -math.inf
    name: str = "mtp"
    """What the draft is called on the line."""
    recent: deque = dataclasses.field(default_factory=lambda: deque(maxlen=21))
    """(step, time) of the last steps: the rate and ETA are over these, not since the start (a
    long run's early steps, compiles or a busy machine would skew them for hours)."""

    def show(self, step: int, aux: dict, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.recent:
            self.recent.append((self.first_step, self.start))
        self.recent.append((step, now))
        if not (self.tty or force or now - self.last >= 10):
            return
        self.last = now
        step0, t0 = self.recent[0]
        rate = (step - step0) * self.tokens_per_step / max(now - t0, 1e-9)
        eta = (self.total - step) * self.tokens_per_step / rate if rate else math.inf
        frac = step / self.total
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        draft = ""
        if "level_agreement" in aux:
            agree = "/".join(f"{a:.2f}" for a in aux["level_agreement"])
            loss = f" {aux['mtp_loss']:.3f}" if "mtp_loss" in aux else ""
            draft = f"{self.name}{loss} agree {agree} "
        line = (
            f"train [{bar}] step {step}/{self.total} loss {aux['loss']:.3f} {draft}"
            f"{rate:,.0f} tok/s ETA {eta / 60:.1f} min"
        )
        sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
        sys.stderr.flush()


def training_window(
    args: argparse.Namespace,
    stream: np.ndarray,
    own_windows: np.ndarray | None,
    step: int,
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """Step ``step``'s batch [batch, seq + 1]: windows of the stream at offsets drawn from (seed,
    step) (or at ``starts``), the last ``own_text`` fraction picked from ``own_windows`` (the
    model's own text)."""
    own = 0 if own_windows is None else round(args.own_text * args.batch)
    if starts is None:
        window = batch_at(stream, args.seed, step, args.batch - own, args.seq + 1)
    else:
        window = np.stack([stream[s : s + args.seq + 1] for s in starts[: args.batch - own]])
    if own:
        pick = np.random.default_rng([args.seed, step, 1]).integers(0, len(own_windows), own)
        window = np.concatenate([window, own_windows[pick]])
    return window


def train_loop(
    args: argparse.Namespace,
    workdir: str,
    state: dict,
    step_fn: Callable[[dict, jax.Array], tuple[dict, dict]],
    stream: np.ndarray,
    own_windows: np.ndarray | None,
    name: str = "mtp",
    warm: Callable[[dict], tuple[dict, int] | None] | None = None,
    on_save: Callable[[dict, int], None] | None = None,
    batch_for: Callable[[int], Any] | None = None,
) -> tuple[dict, dict | None, int, float] | None:
    """The resumable training loop: ``state`` (a dict of pytrees, e.g. parameters and optimizer
    state) restored from the latest orbax save in ``workdir`` when there is one, then
    ``state, aux = step_fn(state, window)`` for the remaining steps (``--stop-after`` of them at
    most) with the progress line, saved every ``--save-every`` steps and at the end of the run.
    Returns (state, the last step's aux or None, the step this run started at, seconds), or None
    when the run stopped before ``--steps`` (rerun to resume).

    With no saved state in ``workdir``, ``warm(state)`` may supply a (state, step) to start from
    instead (weights kept somewhere that outlives this machine); ``on_save(state, step)`` runs at
    every save. ``batch_for(step)`` makes a step's batch (default: :func:`training_window`'s
    windows)."""
    manager = ocp.CheckpointManager(workdir, options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = dict(manager.restore(start, args=ocp.args.StandardRestore(abstract)))
        print(f"resuming from step {start} in {workdir}", file=sys.stderr)
    elif warm is not None and (found := warm(state)) is not None:
        state, start = found
    meter = Meter(args.steps, args.batch * args.seq, first_step=start, name=name)
    aux = None
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    for step in range(start, end):
        if batch_for is None:
            batch = jnp.asarray(training_window(args, stream, own_windows, step))
        else:
            batch = batch_for(step)
        state, aux = step_fn(state, batch)
        if not np.isfinite(float(aux["loss"])):
            raise SystemExit(f"loss is {float(aux['loss'])} at step {step}; lower --lr")
        shown = ("loss", "mtp_loss", "mtp_agreement", "level_agreement")
        stats = {k: np.asarray(aux[k]).tolist() for k in shown if k in aux}
        meter.show(step + 1, stats, force=step + 1 == args.steps)
        if (step + 1) % args.save_every == 0 or step + 1 == end:
            manager.save(step + 1, args=ocp.args.StandardSave(state))
            if on_save is not None:
                on_save(state, step + 1)
    manager.wait_until_finished()
    if end < args.steps:
        print(f"stopped after step {end}; rerun the same command to resume from {workdir}", file=sys.stderr)
        return None
    if meter.tty:
        sys.stderr.write("\n")
    return state, aux, start, time.perf_counter() - meter.start


def with_step_count(opt_state: Any, step: int) -> Any:
    """Optimizer state whose step counters read ``step`` (the learning-rate schedule goes on)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.full_like(x, step) if getattr(p[-1], "name", None) == "count" else x, opt_state
    )


def run_report(args: argparse.Namespace) -> dict:
    """eval.json's account of the optimisation every training script shares."""
    return {
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_seen": args.steps * args.batch * args.seq,
        "lr": args.lr,
        "warmup": args.warmup,
        "seed": args.seed,
    }
