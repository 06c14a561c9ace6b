"""Tokenizers: a byte-level one for CPU runs (no download) and a Hugging Face wrapper.

Both expose what the engines need: ``encode``, ``decode``, ``eos_id``, ``eos_ids``, ``pad_id`` and
``vocab_size``. ``eos_ids`` holds every id that ends a response: a chat model ends its turn with a
token (SmolLM2's ``<|im_end|>``) that may differ from the tokenizer's EOS, and its generation
config may list several; generation stops at any of them. ``eos_id`` (the first of them) is the one
appended where the project writes an ending itself (the warm-up's targets).

``apply_chat_template`` renders chat messages as the model's prompt text, up to and including the
assistant's generation prompt (``task.chat_template``). The text holds the template's special
tokens as text (``<|im_start|>``); ``encode`` reads each back as its single id, as Hugging Face
tokenizers parse special tokens in text. A template that writes the BOS itself, for a tokenizer
whose ``encode`` adds one too, would give two: the rendered text leaves its leading BOS to ``encode``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from rljob.spec import JobSpec


class Tokenizer(Protocol):
    eos_id: int
    eos_ids: tuple[int, ...]
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (0..255) plus BOS 256, EOS 257, PAD 258."""

    bos_id, eos_id, pad_id = 256, 257, 258
    eos_ids: tuple[int, ...] = (257,)
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

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        raise ValueError(
            "task.chat_template: the byte tokenizer (tokenizer.kind bytes) has no chat template; set "
            "tokenizer.kind: huggingface with a chat model's tokenizer, or task.chat_template: false"
        )


class HfTokenizer:
    """A Hugging Face ``AutoTokenizer``; PAD falls back to EOS when the model has none. The stop
    ids are the tokenizer's EOS and every ``eos_token_id`` of the model's generation config (a
    directory's or a hub id's)."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        self.name = name
        self._tok: Any = AutoTokenizer.from_pretrained(name)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {name!r} has no EOS token; generation could never stop")
        self.eos_id = int(self._tok.eos_token_id)
        self.eos_ids = (self.eos_id, *(i for i in generation_eos_ids(name) if i != self.eos_id))
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(self._tok)
        bos = self._tok.bos_token_id
        # whether encode() starts every text with the BOS (SmolLM2's does not; Llama's does)
        self._adds_bos = bos is not None and self._tok.encode("")[:1] == [bos]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` up to their first stop id, special tokens left out."""
        stop = next((i for i, t in enumerate(ids) if t in self.eos_ids), len(ids))
        return str(self._tok.decode(ids[:stop], skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """``messages`` rendered by the tokenizer's chat template, ending with the assistant's
        generation prompt; without the leading BOS when ``encode`` adds one (module docstring)."""
        if not self._tok.chat_template:
            raise ValueError(
                f"task.chat_template: tokenizer {self.name!r} has no chat template; set "
                "task.chat_template: false and write the whole prompt in task.prompt_template, or name "
                "a chat model's tokenizer (tokenizer.name) that has one"
            )
        text = str(self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        bos = self._tok.bos_token
        if self._adds_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        return text


def generation_eos_ids(name: str) -> tuple[int, ...]:
    """The ``eos_token_id`` (an id or a list) of ``name``'s generation config: a directory's
    ``generation_config.json``, or a hub id's (from the hub, or its cache when offline); () if it
    has none (a tokenizer-only directory, or a model without a generation config)."""
    path = Path(name) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
    elif Path(name).is_dir():
        return ()
    else:  # a hub id: a chat model's end of turn is often only in its generation config
        from transformers import GenerationConfig

        try:
            value = GenerationConfig.from_pretrained(name).eos_token_id
        except (OSError, ValueError):  # no generation config on the hub, or offline without it
            return ()
    ids = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(i) for i in ids)


def build_tokenizer(spec: JobSpec) -> Tokenizer:
    """The tokenizer a job spec names."""
    if spec.tokenizer.kind == "bytes":
        return ByteTokenizer()
    name = spec.tokenizer.name or spec.model.name
    assert name is not None  # the spec validator guarantees one of them
    return HfTokenizer(name)
