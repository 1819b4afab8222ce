"""A checkpoint's own tokenizer (``tokenizer.json``) and chat template, for real text.

The toy model reads bytes (:class:`~kvlab.worker.tokenizer.ByteTokenizer`); a real
checkpoint comes with the BPE vocabulary it was trained on. :class:`HFTokenizer` wraps the
``tokenizers`` library with the few methods the engine and the views call — ``encode``,
``decode``, ``token_to_text`` (one token, readable in a block picture) — and renders the
chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``) with jinja2, the way
a chat server turns a conversation into one prompt. Why the template matters for the KV
cache: every turn re-renders the whole conversation, and only a prefix that comes out as
the *same tokens* turn after turn can hit the prefix cache (lesson 15).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["HFTokenizer"]

_VISIBLE = {" ": "\u2423", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _token_text(value: Any) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (both forms appear in tokenizer_config.json)."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """``tokenizer.json`` + the special tokens and chat template of ``tokenizer_config.json``."""

    def __init__(self, directory: str | Path, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"checkpoint {directory}: no tokenizer.json (kvlab reads the fast-tokenizer "
                "file; a checkpoint with only tokenizer.model / vocab.json is not supported)"
            )
        self.directory = directory
        self._tok = Tokenizer.from_file(str(path))
        cfg_path = directory / "tokenizer_config.json"
        self.tokenizer_config: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        gen_path = directory / "generation_config.json"
        gen: dict[str, Any] = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
        self.bos_token = _token_text(self.tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(self.tokenizer_config.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token) if self.bos_token else bos_token_id
        eos = gen.get("eos_token_id", list(eos_token_ids))
        ids = list(eos) if isinstance(eos, list) else [eos]
        if self.eos_token and self._id(self.eos_token) is not None:
            ids.insert(0, self._id(self.eos_token))
        #: Every id that ends an answer (the tokenizer's eos first, then the generation config's).
        self.stop_token_ids: list[int] = list(dict.fromkeys(int(i) for i in ids if i is not None))
        self.eos_token_id: int | None = self.stop_token_ids[0] if self.stop_token_ids else None
        self.chat_template = self._find_template()
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _find_template(self) -> str | None:
        t = self.tokenizer_config.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        if t is None and (self.directory / "chat_template.jinja").is_file():
            t = (self.directory / "chat_template.jinja").read_text(encoding="utf-8")
        return t if isinstance(t, str) else None

    # ----------------------------------------------------------------- text <-> ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: the tokenizer's own additions (Llama's
        ``<s>``); a rendered chat prompt already holds them, so :meth:`encode_chat` turns it off."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        """One token, readable in a block picture: spaces as ``␣``, newlines as ``\\n``."""
        text = self._tok.decode([int(token_id)], skip_special_tokens=False)
        return "".join(_VISIBLE.get(c, c) for c in text)

    def tokens_to_texts(self, ids: Iterable[int]) -> list[str]:
        return [self.token_to_text(t) for t in ids]

    # ----------------------------------------------------------------- chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as one prompt string, rendered by the checkpoint's template.

        ``messages``: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        A checkpoint without a template gets a plain one (``<role>: <content>`` lines, then
        ``assistant:``), said here so that nobody mistakes it for the model's format.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content', got {m!r}")
        if self.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant:" if add_generation_prompt else "")
        try:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ImportError(f"checkpoint {self.directory}: its chat template needs jinja2 (pip install jinja2)") from None

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=None,
        )

    def encode_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """:meth:`apply_chat_template`, tokenized (the template wrote the special tokens itself)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt), add_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r}, vocab_size={self.vocab_size})"
