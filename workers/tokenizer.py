"""Tokenizers: a byte-level one for CPU runs (no download) and a Hugging Face wrapper.

Both expose the same four things the engines need: ``encode``, ``decode``, ``eos_id``, ``pad_id``
and ``vocab_size``.
"""

from __future__ import annotations

from typing import Any, Protocol

from rljob.spec import JobSpec


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (0..255) plus BOS 256, EOS 257, PAD 258."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [self.bos_id, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if i == self.eos_id:
                break
            if 0 <= i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")


class HfTokenizer:
    """A Hugging Face ``AutoTokenizer``; PAD falls back to EOS when the model has none."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(name)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {name!r} has no EOS token; generation could never stop")
        self.eos_id = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return str(self._tok.decode(ids, skip_special_tokens=True))


def build_tokenizer(spec: JobSpec) -> Tokenizer:
    """The tokenizer a job spec names."""
    if spec.tokenizer.kind == "bytes":
        return ByteTokenizer()
    name = spec.tokenizer.name or spec.model.name
    assert name is not None  # the spec validator guarantees one of them
    return HfTokenizer(name)
