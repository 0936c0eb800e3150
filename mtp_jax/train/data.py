"""Training text of the embedded models and their drafts: the Python standard library's source,
split by module into train and held-out sets, a byte-level BPE tokenizer trained on it, the token
stream, resumable training windows, and a target's own greedy continuations (on-policy data).

Each module is one document, ``<|bos|> tokens <|eos|>``; windows are drawn at offsets seeded by
(seed, step), so a resumed run sees the same batches (``scripts/train_tiny.py`` and the draft
training scripts)."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import sysconfig
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mtp_jax.config import ModelConfig

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]


BOS, EOS = 0, 1


SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}


HELDOUT_PERCENT = 5


def stdlib_modules(max_files: int | None = None) -> tuple[str, list[str], list[str]]:
    """(stdlib root, train paths, held-out paths), relative to the root, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        paths += [os.path.relpath(os.path.join(d, f), root) for f in sorted(files) if f.endswith(".py")]
    if not paths:
        raise SystemExit(f"no .py files under the standard library at {root}")
    if max_files:
        paths = paths[:max_files]

    def heldout(rel: str) -> bool:
        return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT

    train = [p for p in paths if not heldout(p)]
    held = [p for p in paths if heldout(p)]
    if not held:  # tiny smoke slices: still hold one module out
        held = [train.pop()]
    return root, train, held


def read_text(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    # every text the models see starts with <|bos|>: the tokenizer's own rule, as transformers reads it
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL[BOS]} $A",
        pair=f"{SPECIAL[BOS]} $A {SPECIAL[BOS]} $B",
        special_tokens=[(SPECIAL[BOS], BOS)],
    )
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All documents as one int32 stream: <|bos|> doc <|eos|> <|bos|> doc <|eos|> ..."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([BOS, *enc.ids, EOS], dtype=np.int32))
    return np.concatenate(parts)


def window_starts(size: int, seed: int, step: int, batch: int, length: int) -> np.ndarray:
    """Offsets [batch] of step ``step``'s windows of ``length`` tokens in a stream of ``size``,
    drawn from (seed, step): resumable."""
    return np.random.default_rng([seed, step]).integers(0, size - length, batch)


class SourceWindows:
    """Window offsets drawn source by source: each window's source with probability ``weights``
    (normalised), then a uniform offset among that source's tokens (its documents' spans in the
    stream; a window may run on into the next document, as the plain draw's do). Drawn from (seed,
    step): resumable. A source's share of the training windows is then its weight, whatever its
    share of the tokens."""

    def __init__(self, starts: np.ndarray, sources: list[str], size: int, weights: dict[str, float]):
        """``starts`` [n]: where each document starts in a stream of ``size`` tokens, ``sources``
        [n]: its source; ``weights``: {source: weight >= 0}, every source present named, some > 0."""
        names = sorted(set(sources))
        unknown = sorted(set(weights) - set(names))
        missing = [n for n in names if n not in weights]
        if unknown or missing or not any(weights[n] > 0 for n in names) or min(weights.values()) < 0:
            raise ValueError(
                f"source weights {weights} must give each of the data's sources {names} a weight >= 0, "
                "some above 0" + (f" (not in the data: {unknown})" if unknown else "")
            )
        ends = np.append(np.asarray(starts, np.int64)[1:], size)
        self.names = [n for n in names if weights[n] > 0]
        total = sum(weights[n] for n in self.names)
        self.shares = np.asarray([weights[n] / total for n in self.names])
        which = np.asarray(sources)
        self.spans = []  # per source: (document starts, cumulative token counts)
        for name in self.names:
            mine = which == name
            self.spans.append(
                (np.asarray(starts, np.int64)[mine], np.cumsum(ends[mine] - np.asarray(starts)[mine]))
            )

    def offsets(self, size: int, seed: int, step: int, batch: int, length: int) -> np.ndarray:
        """[batch] offsets of windows of ``length`` tokens (all inside the stream)."""
        rng = np.random.default_rng([seed, step])
        out = np.empty(batch, np.int64)
        for i, s in enumerate(rng.choice(len(self.names), batch, p=self.shares)):
            begin, cumulative = self.spans[s]
            u = int(rng.integers(0, cumulative[-1]))
            doc = int(np.searchsorted(cumulative, u, side="right"))
            out[i] = begin[doc] + u - (cumulative[doc - 1] if doc else 0)
        return np.minimum(out, size - length - 1)


def batch_at(stream: np.ndarray, seed: int, step: int, batch: int, length: int) -> np.ndarray:
    """Windows [batch, length] of the stream at offsets drawn from (seed, step): resumable."""
    return np.stack([stream[s : s + length] for s in window_starts(len(stream), seed, step, batch, length)])


def own_continuations(
    cfg: ModelConfig,
    params: dict,
    stream: np.ndarray,
    count: int,
    length: int,
    seed: int,
    num_speculative_tokens: int = 3,
) -> np.ndarray:
    """[count, length] windows of the main model's own text: a prompt of 16..length/4 tokens from
    the train stream, continued greedily by the model (EOS does not stop it, as in the benchmark),
    in batches of 64, speculatively with its own draft when it has one (greedy output is plain
    decoding's; ``num_speculative_tokens`` 0 = plain decoding, about as fast at that batch on a CPU).

    At temperature 0 the tokens a draft is scored on are the target's own greedy choices, not
    the training text's, so a draft trained on these windows sees the contexts it is used in
    (on-policy distillation data)."""
    from mtp_jax.model import Model

    rng = np.random.default_rng([seed, 7])
    cut = rng.integers(16, max(17, length // 4) + 1, count)
    starts = rng.integers(0, len(stream) - length, count)
    prompts = [stream[s : s + c].tolist() for s, c in zip(starts, cut, strict=True)]
    model = Model(cfg, params, dtype="float32", eos_token_ids=[EOS])
    draft = model.default_draft if num_speculative_tokens else None
    out = np.zeros((count, length), np.int32)
    t0, chunk, made = time.perf_counter(), 256, 0
    for i in range(0, count, chunk):
        part = prompts[i : i + chunk]
        result = model.generate(
            part,
            max_new_tokens=length - min(map(len, part)),
            draft=draft,
            num_speculative_tokens=num_speculative_tokens if draft else None,
            ignore_eos=True,
            max_batch=64,
        )
        for j, (p, new) in enumerate(zip(part, result.tokens, strict=True)):
            out[i + j] = (p + new)[:length]
        made += sum(map(len, result.tokens))
        done = min(i + chunk, count)
        rate = made / (time.perf_counter() - t0)
        print(f"own continuations: {done}/{count} windows ({rate:,.0f} new tok/s)", file=sys.stderr)
    return out


def continuations_path(workdir: str, count: int, length: int, seed: int) -> str:
    return f"{workdir}.continuations-{count}x{length}-seed{seed}.npy"


def load_or_make_continuations(
    workdir: str,
    cfg: ModelConfig,
    params: dict,
    stream: np.ndarray,
    count: int,
    length: int,
    seed: int,
    num_speculative_tokens: int = 3,
) -> np.ndarray:
    """:func:`own_continuations`, kept beside the training state so a resumed run reuses them."""
    path = continuations_path(workdir, count, length, seed)
    if os.path.isfile(path):
        return np.load(path)
    data = own_continuations(cfg, params, stream, count, length, seed, num_speculative_tokens)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # --out's parent may not exist yet
    tmp = path + f".tmp-{os.getpid()}.npy"
    np.save(tmp, data)
    os.replace(tmp, path)
    return data


def data_report(train_files: list[str], held_files: list[str], train: np.ndarray, held: np.ndarray) -> dict:
    """eval.json's account of the data: the split and its token counts."""
    return {
        "source": "Python standard library source code (.py files; tests, demos, site-packages excluded)",
        "python": platform.python_version(),
        "train_modules": len(train_files),
        "heldout_modules": len(held_files),
        "heldout_percent": HELDOUT_PERCENT,
        "train_tokens": int(len(train)),
        "heldout_tokens": int(len(held)),
    }
