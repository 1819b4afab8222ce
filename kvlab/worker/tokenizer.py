"""A byte-level tokenizer: one token per UTF-8 byte, plus a few special tokens.

Why bytes? kvlab is about where token states live, not about language. With one token per
byte every string round-trips exactly, the vocabulary is tiny (so the toy model stays
small), and a picture of a KV block can print the very characters whose keys and values
sit in it: a 16-token block holds 16 bytes of text. ``token_to_text`` renders one token so
that invisible characters (spaces, newlines) stay visible in those pictures.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvlab.utils.checks import check_int

__all__ = ["ByteTokenizer", "BOS_TOKEN_ID", "EOS_TOKEN_ID", "PAD_TOKEN_ID"]

NUM_BYTE_TOKENS = 256
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258

_SPECIAL_NAMES: dict[int, str] = {
    BOS_TOKEN_ID: "<bos>",
    EOS_TOKEN_ID: "<eos>",
    PAD_TOKEN_ID: "<pad>",
}

# Visible stand-ins for bytes that would otherwise print as nothing (or break a table row).
_VISIBLE: dict[int, str] = {
    0x20: "\u2423",  # '␣' OPEN BOX: a space you can see
    0x0A: "\\n",
    0x09: "\\t",
    0x0D: "\\r",
}


class ByteTokenizer:
    """Token ids 0..255 are the bytes of the UTF-8 encoding; 256.. are special tokens.

    ``vocab_size`` is 259: 256 bytes + ``<bos>`` (256) + ``<eos>`` (257) + ``<pad>`` (258).
    Decoding skips special tokens by default and replaces invalid UTF-8 (a model may emit
    half of a multi-byte character) with U+FFFD instead of raising, because generated text
    from a random toy model is rarely valid UTF-8.
    """

    bos_token_id: int = BOS_TOKEN_ID
    eos_token_id: int = EOS_TOKEN_ID
    pad_token_id: int = PAD_TOKEN_ID
    vocab_size: int = NUM_BYTE_TOKENS + len(_SPECIAL_NAMES)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as token ids (with ``<bos>`` first if asked)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [BOS_TOKEN_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text.

        Special tokens are dropped (``skip_special_tokens=True``) or written as their names,
        e.g. ``'<eos>'``. Byte runs are decoded together so multi-byte characters survive.
        """
        out: list[str] = []
        run = bytearray()
        vocab = self.vocab_size
        for i, tok in enumerate(ids):
            if type(tok) is not int or not 0 <= tok < vocab:
                tok = self._check_id(tok, f"ids[{i}]")
            if tok < NUM_BYTE_TOKENS:
                run.append(tok)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if not skip_special_tokens:
                out.append(_SPECIAL_NAMES[tok])
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_text(self, token_id: int) -> str:
        """A short printable rendering of ONE token, for block pictures.

        Printable ASCII is itself; space is ``'␣'``; newline/tab/CR are ``'\\n'``, ``'\\t'``,
        ``'\\r'``; other control bytes and the bytes of multi-byte characters (which mean
        nothing alone) are hex escapes like ``'\\xe2'``; special tokens are their names.
        """
        token_id = self._check_id(token_id, "token_id")
        if token_id >= NUM_BYTE_TOKENS:
            return _SPECIAL_NAMES[token_id]
        if token_id in _VISIBLE:
            return _VISIBLE[token_id]
        if 0x21 <= token_id <= 0x7E:
            return chr(token_id)
        return f"\\x{token_id:02x}"

    def tokens_to_texts(self, ids: Iterable[int]) -> list[str]:
        """``token_to_text`` for each id: the labels of the cells of a KV block."""
        return [self.token_to_text(t) for t in ids]

    def _check_id(self, token_id: object, name: str) -> int:
        """Return ``token_id`` as a plain int (numpy/torch integers welcome) or raise."""
        return check_int(name, token_id, 0, self.vocab_size - 1)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"
