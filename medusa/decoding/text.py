"""Token ids to text as they are accepted: an incremental detokenizer.

Decoding each chunk of ids on its own goes wrong in two ways. A SentencePiece tokenizer
(Llama-2, Gemma, Mistral) strips the space of a chunk's first token (``"▁world"`` alone decodes
to ``"world"``), so streamed words run together; and a character whose UTF-8 bytes are split
over tokens (emoji, CJK under byte fallback or byte-level BPE) decodes to U+FFFD halves.
:class:`TextStream` decodes a running window instead: the text of the ids since the last
printed boundary, minus the text already printed, held back while it ends in an incomplete
character. Where the tokenizer has a fast (tokenizers) backend, the tokenizers library's own
``DecodeStream`` runs that window in Rust.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes of a character not complete yet
DECODE_STREAM = "decode-stream"
WINDOW = "window"


def _decode_stream_class():
    """``tokenizers.decoders.DecodeStream`` (tokenizers >= 0.21), else None."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return DecodeStream


def pick_method(tokenizer) -> str:
    """``"decode-stream"`` where the tokenizers library can stream for ``tokenizer``: it has a fast
    backend, the installed tokenizers has ``DecodeStream``, and ``decode`` does not clean up
    spaces afterwards (``clean_up_tokenization_spaces``: ``"a ."`` -> ``"a."``, which
    ``DecodeStream`` does not do); else ``"window"`` (the same window through ``tokenizer.decode``)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None or _decode_stream_class() is None:
        return WINDOW
    return WINDOW if getattr(tokenizer, "clean_up_tokenization_spaces", False) else DECODE_STREAM


class TextStream:
    """Text of a growing list of token ids, piece by piece.

    ``push(ids)`` returns the text those ids make printable, ``flush()`` whatever is still held
    back at the end (an incomplete character, then as ``tokenizer.decode`` renders it). The
    pieces joined equal ``tokenizer.decode(all_ids, skip_special_tokens=...)``, with one
    exception: under byte fallback (SentencePiece), ``decode`` renders a run of byte tokens that
    is not valid UTF-8 as one U+FFFD per byte, even bytes that were a whole character before the
    run went wrong; a stream has printed those already (a trained model's text rarely holds such a run).

    ``method``: ``"decode-stream"`` (tokenizers' ``DecodeStream``), ``"window"``
    (``tokenizer.decode`` over the running window, for any tokenizer), or None:
    :func:`pick_method`.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, method: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.method = method or pick_method(tokenizer)
        if self.method not in (DECODE_STREAM, WINDOW):
            raise ValueError(f"unknown method {self.method!r}: {DECODE_STREAM!r} or {WINDOW!r}")
        self.ids: list[int] = []
        # The window: ids[prefix:read] printed as prefix text; ids[read:] not printed yet.
        # Decoding from ``prefix`` rather than ``read`` keeps the leading space a SentencePiece
        # decoder strips from the first token of whatever it decodes.
        self.prefix = 0
        self.read = 0
        self.flushed = False
        if self.method == DECODE_STREAM:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise ValueError(f"{type(tokenizer).__name__} has no fast (tokenizers) backend: use method='window'")
            self._backend = backend
            self._stream = _decode_stream_class()(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: int | Iterable[int]) -> str:
        """The text that ``ids`` (appended to those pushed before) make printable; "" while a
        character is incomplete."""
        if self.flushed:
            raise ValueError("this TextStream was flushed: start a new one for more text")
        new = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        if self.method == DECODE_STREAM:
            pieces = []
            for k, token in enumerate(new):
                self.ids.append(token)
                try:
                    piece = self._stream.step(self._backend, token)
                except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception)
                    # "Invalid prefix": under byte fallback a run of byte tokens that turns out
                    # invalid UTF-8 is rendered anew by decode() (every byte of it as U+FFFD,
                    # bytes already printed included), which DecodeStream refuses. The window
                    # goes on from the last piece printed.
                    self.method = WINDOW
                    self.ids.extend(new[k + 1:])
                    return "".join(pieces) + self._advance(final=False)
                if piece is not None:  # None: held back (incomplete bytes, or nothing printable yet)
                    pieces.append(piece)
                    # the window as DecodeStream moves its own (only flush() reads it on this path)
                    self.prefix, self.read = self.read, len(self.ids)
            return "".join(pieces)
        self.ids.extend(new)
        return self._advance(final=False)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        printed = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(printed) or text.endswith(REPLACEMENT)):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        if text.startswith(printed):
            return text[len(printed):]
        # decode() re-rendered an invalid byte run (see the class): what was printed stays
        # printed, and the text goes on from where the two renderings part.
        return text[len(os.path.commonprefix([printed, text])):]

    def flush(self) -> str:
        """The rest, at the end of the stream: text held back, as ``tokenizer.decode`` renders it
        (an incomplete character as U+FFFD). Nothing can be pushed after it."""
        self.flushed = True
        if self.method == DECODE_STREAM and self.read < len(self.ids):
            self.method = WINDOW  # DecodeStream keeps its held-back ids inside: the same window renders them
        return self._advance(final=True)

    def text(self) -> str:
        """The text of every id pushed so far (``tokenizer.decode`` of them all)."""
        return self._decode(self.ids)
