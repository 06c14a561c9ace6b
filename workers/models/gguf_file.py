"""Reading a GGUF file's header (the format ``fp8rl model fetch`` and ``import`` convert from), and
the error every step of a fetch or import raises (:class:`ModelStoreError`, re-exported by
:mod:`workers.models.store`)."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"


class ModelStoreError(Exception):
    """A fetch or import that cannot go on; the message says what was wrong and what to do."""


def check_gguf(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelStoreError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


# GGUF metadata value types (the GGUF spec): fixed-size scalars by struct format, 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The scalar and string key/values of a GGUF file's header (arrays, such as the vocabulary,
    are skipped): ``general.architecture``, ``general.file_type``, ``tokenizer.ggml.*_token_id``."""

    def read(f: BinaryIO, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = f.read(size)
        if len(data) != size:
            raise ModelStoreError(f"{path}: truncated GGUF header")
        return struct.unpack("<" + fmt, data)[0]

    def string(f: BinaryIO) -> str:
        return bytes(f.read(read(f, "Q"))).decode("utf-8", errors="replace")

    def value(f: BinaryIO, kind: int) -> Any:
        if kind in _SCALARS:
            return read(f, _SCALARS[kind])
        if kind == _STRING:
            return string(f)
        if kind == _ARRAY:
            item, count = read(f, "I"), read(f, "Q")
            if item in _SCALARS:
                f.seek(count * struct.calcsize("<" + _SCALARS[item]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    value(f, item)
            return None
        raise ModelStoreError(f"{path}: unknown GGUF value type {kind}")

    out: dict[str, Any] = {}
    with path.open("rb", buffering=1 << 16) as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelStoreError(f"{path} is not a GGUF file")
        version = read(f, "I")
        if version not in (2, 3):
            raise ModelStoreError(f"{path}: GGUF version {version} (little-endian 2 or 3 is read)")
        _tensors, count = read(f, "Q"), read(f, "Q")
        for _ in range(count):
            key = string(f)
            found = value(f, read(f, "I"))
            if found is not None:
                out[key] = found
    return out


def weights_note(meta: dict[str, Any]) -> str:
    """How the float32 weights relate to the GGUF file's tensors, from ``general.file_type``."""
    from gguf import LlamaFileType

    kind = meta.get("general.file_type")
    try:
        label = LlamaFileType(kind).name.removeprefix("MOSTLY_") if kind is not None else "unknown"
    except ValueError:
        label = f"file type {kind}"
    if label in ("ALL_F32", "F16", "BF16"):
        return f"{label} widened to float32: the GGUF file's values exactly"
    return f"{label} dequantized: not bit-identical to an unquantized release"
