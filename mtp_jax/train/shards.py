"""A corpus on disk: compact shards small enough to commit, written so that none is ever half there.

A corpus directory holds

* ``manifest.json``: what the corpus is (the target, the plan's digest and record, the sampling
  and limits, the shard size). A rerun with other settings is refused naming what differs, so a
  corpus never mixes two regimes.
* ``shard-NNNNN.npz``: the conversations ``[N * shard_size, (N + 1) * shard_size)`` of the plan
  (fewer in the last shard of a ``--limit`` run), ``np.savez_compressed``:

  ====================  =======================================================================
  ``tokens``            flat token ids (uint16 when the vocabulary fits, else uint32)
  ``offsets``           int64 [n + 1]: conversation ``i`` is ``tokens[offsets[i]:offsets[i+1]]``
  ``reply_mask``        bool, one per token: True for the target's regenerated reply tokens
                        (EOS included when it ended a reply), False for prompts and template text
  ``source``, ``ids``   per conversation: its source label and id (the plan's)
  ``index``             per conversation: its position in the plan
  ``end``               per conversation: why it ended ("done": every user turn answered; "cap":
                        the context cap; "template": the chat template did not extend the
                        conversation's text, so it stopped there)
  ``turn_offsets``      int64 [n + 1] into ``finish``
  ``finish``            per regenerated reply: "eos", "length" (max_new_tokens or the cap), ...
  ``meta``              a JSON string: shard number, plan range, the plan's digest
  ====================  =======================================================================

  Each shard is written to a temporary name and renamed (atomic on POSIX), so a process killed at
  any moment leaves whole shards and at most a stray temporary file, removed by the next run.
* ``progress.json`` and ``CARD.md``: rewritten after every shard (counts, throughput per run).

The shard files are the truth: progress is rebuilt from them, so a process killed between a
shard's rename and the progress file's update loses nothing.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np

SHARD_PATTERN = re.compile(r"^shard-(\d{5})\.npz$")
FORMAT = "mtp-jax-distill-corpus/1"


def shard_path(directory: str, number: int) -> str:
    return os.path.join(directory, f"shard-{number:05d}.npz")


@dataclasses.dataclass
class Conversation:
    """One regenerated conversation as the training scripts read it."""

    id: str
    source: str
    index: int  # position in the plan
    tokens: np.ndarray  # int32 [T]: the whole rendered conversation
    reply_mask: np.ndarray  # bool [T]: the target's own reply tokens
    finish: tuple[str, ...]  # one per regenerated reply
    end: str

    @property
    def reply_tokens(self) -> int:
        return int(self.reply_mask.sum())


@dataclasses.dataclass
class ShardRecord:
    """What a finished shard holds (read back from its file)."""

    number: int
    start: int  # plan range [start, stop)
    stop: int
    conversations: int
    tokens: int
    reply_tokens: int
    by_source: dict[str, dict[str, int]]
    ends: dict[str, int]
    finishes: dict[str, int]


def write_shard(
    directory: str,
    number: int,
    start: int,
    conversations: Sequence[Conversation],
    *,
    plan_digest: str,
    vocab_size: int,
) -> str:
    """Write conversations ``start..`` of the plan as shard ``number``: to a temporary file first,
    flushed to disk, then renamed over the final name."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    lengths = [len(c.tokens) for c in conversations]
    turns = [len(c.finish) for c in conversations]
    arrays = {
        "tokens": np.concatenate([np.asarray(c.tokens) for c in conversations]).astype(dtype)
        if conversations
        else np.zeros(0, dtype),
        "offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        "reply_mask": np.concatenate([np.asarray(c.reply_mask, bool) for c in conversations])
        if conversations
        else np.zeros(0, bool),
        "source": np.asarray([c.source for c in conversations], dtype=str),
        "ids": np.asarray([c.id for c in conversations], dtype=str),
        "index": np.asarray([c.index for c in conversations], np.int64),
        "end": np.asarray([c.end for c in conversations], dtype=str),
        "turn_offsets": np.concatenate([[0], np.cumsum(turns, dtype=np.int64)]).astype(np.int64),
        "finish": np.asarray([f for c in conversations for f in c.finish], dtype=str),
        "meta": np.asarray(
            json.dumps(
                {
                    "format": FORMAT,
                    "shard": number,
                    "start": start,
                    "stop": start + len(conversations),
                    "plan_digest": plan_digest,
                }
            )
        ),
    }
    final = shard_path(directory, number)
    temporary = f"{final}.tmp{os.getpid()}"
    with open(temporary, "wb") as f:
        np.savez_compressed(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, final)
    return final


def read_shard(path: str) -> list[Conversation]:
    with np.load(path, allow_pickle=False) as z:
        tokens, offsets, mask = z["tokens"], z["offsets"], z["reply_mask"]
        turn_offsets, finish = z["turn_offsets"], z["finish"]
        out = []
        for i in range(len(offsets) - 1):
            a, b = int(offsets[i]), int(offsets[i + 1])
            out.append(
                Conversation(
                    id=str(z["ids"][i]),
                    source=str(z["source"][i]),
                    index=int(z["index"][i]),
                    tokens=tokens[a:b].astype(np.int32),
                    reply_mask=mask[a:b].astype(bool),
                    finish=tuple(str(f) for f in finish[turn_offsets[i] : turn_offsets[i + 1]]),
                    end=str(z["end"][i]),
                )
            )
    return out


def shard_meta(path: str) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["meta"]))


def summarise_shard(path: str) -> ShardRecord:
    """A shard's counts (per source: conversations, tokens, reply tokens; ends; reply finishes)."""
    meta = shard_meta(path)
    by_source: dict[str, dict[str, int]] = {}
    ends: dict[str, int] = {}
    finishes: dict[str, int] = {}
    tokens = reply = 0
    conversations = read_shard(path)
    for c in conversations:
        row = by_source.setdefault(c.source, {"conversations": 0, "tokens": 0, "reply_tokens": 0})
        row["conversations"] += 1
        row["tokens"] += len(c.tokens)
        row["reply_tokens"] += c.reply_tokens
        tokens += len(c.tokens)
        reply += c.reply_tokens
        ends[c.end] = ends.get(c.end, 0) + 1
        for f in c.finish:
            finishes[f] = finishes.get(f, 0) + 1
    return ShardRecord(
        meta["shard"],
        meta["start"],
        meta["stop"],
        len(conversations),
        tokens,
        reply,
        by_source,
        ends,
        finishes,
    )


def finished_shards(directory: str, plan_digest: str | None = None) -> dict[int, ShardRecord]:
    """Every whole shard in ``directory`` by number (stray temporary files removed: they are what a
    killed writer left). With ``plan_digest``, a shard of another plan is an error."""
    out: dict[int, ShardRecord] = {}
    if not os.path.isdir(directory):
        return out
    for stray in glob.glob(os.path.join(directory, "shard-*.npz.tmp*")):
        os.remove(stray)
    for name in sorted(os.listdir(directory)):
        m = SHARD_PATTERN.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        if plan_digest is not None and shard_meta(path).get("plan_digest") != plan_digest:
            raise ValueError(f"{path} belongs to another plan (another source, mix or seed): move it away")
        out[int(m.group(1))] = summarise_shard(path)
    return out


def iter_conversations(directory: str, sources: Sequence[str] | None = None) -> Iterator[Conversation]:
    """Every conversation of a corpus directory in plan order (shard by shard), optionally only
    those of some sources; conversations without a single reply token are skipped."""
    names = sorted(n for n in os.listdir(directory) if SHARD_PATTERN.match(n))
    for name in names:
        for c in read_shard(os.path.join(directory, name)):
            if (sources is None or c.source in sources) and c.reply_tokens:
                yield c


HELDOUT_FRACTION = 0.02
"""The share of a corpus's conversations the training scripts hold out (by a hash of the id)."""


def held_out(conversation_id: str, fraction: float) -> bool:
    """Whether a conversation is held out: a fixed function of its id, so a corpus that grows keeps
    every conversation it had on the same side of the split."""
    h = int.from_bytes(hashlib.sha256(conversation_id.encode()).digest()[:8], "big")
    return h < fraction * 2.0**64


def first_turn(c: Conversation) -> np.ndarray:
    """The conversation up to its first reply token: the first user turn as the target was prompted
    with it (chat template and generation prompt included)."""
    return c.tokens[: int(np.argmax(c.reply_mask))]


@dataclasses.dataclass
class CorpusSplit:
    """A corpus as a draft trains on it: the training conversations as one stream, the held-out
    ones as another, and the held-out first turns as prompts."""

    shards: list[str]
    train_stream: np.ndarray
    train_starts: np.ndarray  # where each training conversation starts in the stream
    train_sources: list[str]  # each training conversation's source
    held_stream: np.ndarray
    held_prompts: list[list[int]]  # held-out first turns, the sources taken in turn
    held_sources: list[str]  # each prompt's source
    counts: dict[str, dict[str, dict[str, int]]]  # {"train"|"heldout": {source: counts}}


def read_manifest(directory: str) -> dict:
    """A corpus directory's manifest; a directory that is not a corpus is named."""
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{directory} is not a corpus (no manifest.json): build one with scripts/build_corpus.py"
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def split_corpus(directory: str, fraction: float, shards: Sequence[str] | None = None) -> CorpusSplit:
    """The finished shards of ``directory`` (or exactly the named ``shards``: a resumed run reads what
    it started with while the corpus grows) split by :func:`held_out`."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {fraction}")
    names = (
        list(shards)
        if shards is not None
        else sorted(n for n in os.listdir(directory) if SHARD_PATTERN.match(n))
    )
    missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise FileNotFoundError(
            f"{directory} lacks {len(missing)} shard(s) this run started with: {missing[:3]}"
        )
    if not names:
        raise ValueError(f"{directory} has no finished shard yet")
    train: list[np.ndarray] = []
    train_sources: list[str] = []
    held: list[np.ndarray] = []
    prompts: dict[str, list[list[int]]] = {}
    counts: dict[str, dict[str, dict[str, int]]] = {"train": {}, "heldout": {}}
    for name in names:
        for c in read_shard(os.path.join(directory, name)):
            if not c.reply_tokens:
                continue
            side = "heldout" if held_out(c.id, fraction) else "train"
            (held if side == "heldout" else train).append(c.tokens)
            if side == "train":
                train_sources.append(c.source)
            if side == "heldout":
                prompts.setdefault(c.source, []).append(first_turn(c).tolist())
            row = counts[side].setdefault(c.source, {"conversations": 0, "tokens": 0, "reply_tokens": 0})
            row["conversations"] += 1
            row["tokens"] += len(c.tokens)
            row["reply_tokens"] += c.reply_tokens
    if not train or not held:
        raise ValueError(
            f"{directory}: {len(train)} training and {len(held)} held-out conversations at a held-out "
            f"fraction of {fraction}: both sides need at least one (grow the corpus or change the fraction)"
        )
    order = sorted(prompts)
    interleaved = [
        (prompts[s][i], s)
        for i in range(max(len(v) for v in prompts.values()))
        for s in order
        if i < len(prompts[s])
    ]
    lengths = np.asarray([len(t) for t in train], np.int64)
    return CorpusSplit(
        names,
        np.concatenate(train).astype(np.int32),
        np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        train_sources,
        np.concatenate(held).astype(np.int32),
        [p for p, _ in interleaved],
        [s for _, s in interleaved],
        counts,
    )


def write_json(path: str, value: object, indent: int = 1) -> None:
    """JSON written to a temporary file and renamed: a reader never sees half a file."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=indent, ensure_ascii=False)
        f.write("\n")
    os.replace(temporary, path)


def write_text(path: str, text: str) -> None:
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)
