"""Text in and out: a model's ``tokenizer.json``, its chat template, streaming detokenisation
that never splits a character, and stop strings.

The chat template (``tokenizer_config.json``'s ``chat_template``, a string or a list of named
templates) is rendered by Jinja2 in its sandbox, as ``transformers`` renders it (``messages``,
``add_generation_prompt``, ``bos_token``/``eos_token``, ``raise_exception``, ``strftime_now``);
Jinja2 comes with the ``serve`` extra (``pip install 'mtp-jax[serve]'``).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mtp_jax.errors import InvalidRequestError

REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes an incomplete UTF-8 sequence to


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextCodec:
    """Encode and decode a model's text; render its chat template.

    Whether ``encode`` starts a prompt with BOS is the tokenizer's own rule, as ``transformers`` (5)
    reads it: tokenizer.json's post-processor (a ``TemplateProcessing`` that adds it, as Llama 3's
    and the embedded models' do; a ``ByteLevel`` one, as SmolLM2's, adds nothing). tokenizer_config
    .json's ``add_bos_token`` is ignored beside a tokenizer.json, as there. A GGUF's
    ``tokenizer.ggml.add_bos_token`` becomes such a post-processor
    (:meth:`mtp_jax.checkpoint.gguf.GGUFCheckpoint.tokenizer_json`)."""

    def __init__(self, tokenizer: Any, config: Mapping | None = None) -> None:
        """``tokenizer``: a ``tokenizers.Tokenizer``; ``config``: tokenizer_config.json's content."""
        self.tokenizer = tokenizer
        self.config: dict = dict(config or {})
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._compiled = None

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """An upper bound on the characters one token can stand for (its vocabulary entry's length:
        byte-level and metaspace entries never decode to more characters than they have), so a
        text longer than ``n`` times this needs more than ``n`` tokens without being tokenised."""
        return max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_dir(cls, model_dir: str) -> TextCodec:
        """A checkpoint directory's tokenizer.json and (when present) tokenizer_config.json."""
        from tokenizers import Tokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise InvalidRequestError(f"text in and out needs the model's tokenizer.json: {path} is missing")
        config: dict = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"{config_path} is not valid JSON: {e}") from None
        return cls(Tokenizer.from_file(path), config)

    @classmethod
    def from_gguf(cls, ckpt: Any) -> TextCodec:
        """A GGUF file's own tokenizer and chat template (:class:`mtp_jax.checkpoint.gguf.GGUFCheckpoint`)."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(ckpt.tokenizer_json()), ckpt.tokenizer_config())

    @classmethod
    def for_path(cls, path: str) -> TextCodec:
        """The tokenizer of a model path: a GGUF file or a checkpoint directory."""
        if os.path.isfile(path):
            from mtp_jax.checkpoint.gguf import GGUFCheckpoint

            return cls.from_gguf(GGUFCheckpoint(path))
        return cls.from_dir(path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` (prompts: yes; a rendered chat, which
        carries its own, no) applies the tokenizer's BOS rule."""
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"a prompt must be a string or a list of token ids, got {type(text).__name__}"
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: object, add_generation_prompt: bool = True) -> list[int]:
        """The token ids of the rendered chat (``apply_chat_template(..., tokenize=True)``)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's text on its own, special tokens included (how log-probabilities name
        tokens; a token holding part of a character decodes to U+FFFD)."""
        return self.tokenizer.decode([int(token)], skip_special_tokens=False)

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.tokenizer)

    def render_chat(self, messages: object, add_generation_prompt: bool = True) -> str:
        """The chat template applied to OpenAI-style ``messages`` ([{"role", "content"}, ...])."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template (tokenizer_config.json chat_template)")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"message {i} must be an object with a string 'role'")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise InvalidRequestError(f"message {i}: content must be a string or a list of parts")
        template = self._template()
        try:
            return template.render(
                messages=[_plain_content(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=_token_text(self.config.get("bos_token")) or "",
                eos_token=_token_text(self.config.get("eos_token")) or "",
            )
        except InvalidRequestError:
            raise
        except Exception as e:  # a template error is a property of the request (or the template)
            raise InvalidRequestError(f"the chat template failed on these messages: {e}") from None

    def _template(self):
        if self._compiled is None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError as e:
                raise InvalidRequestError(
                    "chat templates are rendered by Jinja2: pip install 'mtp-jax[serve]'"
                ) from e

            def raise_exception(message: str) -> None:
                raise InvalidRequestError(f"the chat template refused the messages: {message}")

            def strftime_now(fmt: str) -> str:
                return datetime.datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled


def _plain_content(message: Mapping) -> dict:
    """A message whose content is a list of text parts (OpenAI's array form) joined into one string."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError("only text content parts are supported")
            parts.append(part["text"])
        out["content"] = "".join(parts)
    return out


class IncrementalDecoder:
    """Text of a growing token sequence, piece by piece: a piece is released only once it no longer
    ends inside a multi-byte character (byte-level tokens may split one), and decoding a window
    that starts a few tokens back keeps tokenizers' spacing rules (a leading space) right."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # decoding starts here (context for spacing)
        self.read = 0  # text up to here has been released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; the text it completes ("" while a character is incomplete)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end decodes as U+FFFD)."""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]


class StopStrings:
    """Streaming stop strings: text goes in piece by piece; what may be released comes out. Text
    that could be the start of a stop string is held back until it is not; once a stop string
    appears, the text before it is released and the rest is dropped (the stop string is not part
    of the output, as in OpenAI's API)."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[: min(hits)]
        keep = 0
        for s in self.stops:  # the longest tail of buf that begins some stop string
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if s.startswith(buf[-n:]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


class TextStream:
    """One request's text: tokens in (EOS and other special tokens decode to nothing), released
    text out, stop strings applied. ``push`` returns (text, stop) with stop True once a stop
    string has appeared."""

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self.decoder = codec.decoder()
        self.stops = StopStrings(stops)
        self.text = ""

    def push(self, token: int) -> tuple[str, bool]:
        piece = self.stops.push(self.decoder.push(token))
        self.text += piece
        return piece, self.stops.stopped

    def finish(self) -> str:
        """The text held back at the end of the request."""
        piece = self.stops.push(self.decoder.flush())
        piece += self.stops.flush()
        self.text += piece
        return piece


def check_stops(stop: object) -> list[str]:
    """``stop`` as the API takes it: None, a string, or a list of non-empty strings (at most 16)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if len(stops) > 16:
        raise InvalidRequestError(f"at most 16 stop strings, got {len(stops)}")
    return list(stops)
