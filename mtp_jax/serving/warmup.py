"""Compiling an engine's programs before requests need them: all at once, or in the background
one program at a time whenever no request runs."""

from __future__ import annotations

from collections.abc import Callable

from mtp_jax.scheduler import Scheduler

Progress = Callable[[int, int], None]
"""``progress(done, total)``, called on the engine's thread after each program."""


class Warmup:
    """The warm-up of one engine's scheduler: every prefill and step program a request without a
    grammar can need (prompts up to ``longest`` tokens, K in ``ks``)."""

    def __init__(self, scheduler: Scheduler, longest: int, ks: range) -> None:
        self.scheduler, self.scope = scheduler, (longest, ks)
        self.jobs: list[tuple] = []  # a background warm-up's programs left
        self.progress: Progress | None = None
        self.total = self.done = 0

    @property
    def left(self) -> int:
        """Programs a background warm-up has still to compile."""
        return self.total - self.done

    def run(self, progress: Progress | None) -> int:
        """Compile them all now (a background warm-up under way has nothing left to do)."""
        self.jobs, self.total, self.done = [], 0, 0
        return self.scheduler.warmup(*self.scope, progress)

    def plan(self) -> list[tuple]:
        """(Any thread.) The background warm-up's programs, smallest first; counted at once, so
        that the engine's stats show them before its thread has started on them."""
        jobs = self.scheduler.warmup_jobs(*self.scope)
        self.total, self.done = len(jobs), 0
        return jobs

    def start(self, jobs: list[tuple], progress: Progress | None) -> None:
        """(The engine's thread.) Compile ``jobs`` one per idle turn from now on."""
        self.jobs, self.progress = list(jobs), progress

    def next_job(self) -> tuple | None:
        """(The engine's thread, idle.) The next program to compile, or None."""
        return self.jobs.pop(0) if self.jobs else None

    def compile(self, job: tuple) -> None:
        self.scheduler.warmup_job(*job)
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
