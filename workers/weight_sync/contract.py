"""The precision contract of a weight sync: what the generator holds is what the trainer sent.

Silent BF16 fallbacks and wrong scale formats are the FP8 RL bugs users report most: an engine
loads an FP8 checkpoint into a BF16 layer, drops a scale it has no parameter for, or re-rounds
scales, and nothing fails; only the mismatch grows. So after every weight update each generator
reports, per weight, what it holds, and the driver compares it with what the trainer sent
(:func:`compare`). A difference fails the step, naming the weight and what differs.

What a report says, per payload name (:class:`HeldWeight`):
- ``dtype``: the dtype of the bytes (FP8 weights: their data), as sent or as received;
- ``holds``: the precision the layer computes with after loading: ``fp8`` for an FP8 layer, else
  the dtype of the parameter the weight went into (``bfloat16``, ``float32``);
- ``data`` and ``scale``: checksums (:func:`checksum`) of the data and, for FP8 weights, of the
  float32 scales, over the bytes as they travelled: the trainer's over what it sent, the
  generator's over what it received, before its engine's own post-load processing (vLLM may
  transpose or repack what it loads). 0 for ``scale`` where there is none.

And for the KV cache (:class:`KvHeld`): its element dtype, and the per-layer K/V scales the
generator's attention layers hold after the update, which must be the ones the trainer
calibrated and sent (``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` in the payload). A
generator that calibrates its own scales per batch (the native one) reports none.

A report is plain data (str, int, float, lists and dicts): it crosses Ray and vLLM's
``collective_rpc``, whose arguments and results must never hold tensors.

The checksum is position-weighted (an Adler-like sum: ``sum(byte_i * (1 + i mod 65521))`` over
the tensor's bytes in memory order, in int64 on the tensor's device), so reordered bytes or
blocks are caught, not only changed ones; all of a report's checksums are read back in one
transfer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.fp8.dispatch import triton_switch
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.weight_sync.data import HeldWeight, KvHeld, WeightReport

_MODULUS = 65521  # the largest prime below 2**16 (Adler-32's)
_CHUNK_BYTES = 1 << 24  # 16 MiB of a weight at a time: at most 64 MiB of int32 temporaries
# vLLM's names of FP8 KV-cache formats -> the element dtype (torch's name)
_KV_CACHE_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


class WeightContractError(RuntimeError):
    """What a generator holds differs from what the trainer sent."""


@dataclass
class ContractCheck:
    """The outcome of :func:`compare`: how many weights were checked, and what differs."""

    checked: int
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def raise_if_failed(self, generator: str = "the generator") -> None:
        if self.mismatches:
            shown = "\n  - ".join(self.mismatches[:10])
            more = f"\n  ... and {len(self.mismatches) - 10} more" if len(self.mismatches) > 10 else ""
            raise WeightContractError(
                f"weight sync: {generator} does not hold what the trainer sent "
                f"({len(self.mismatches)} of {self.checked} weights differ):\n  - {shown}{more}"
            )


def kv_cache_dtype(fp8_kv_cache: bool) -> str:
    """The element dtype of a generator's KV cache under ``precision.fp8_kv_cache`` (E4M3, or the
    BF16 the generators compute in)."""
    return "float8_e4m3fn" if fp8_kv_cache else "bfloat16"


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16``, ``float8_e4m3fn``, ... (torch's name without the ``torch.`` prefix)."""
    return str(dtype).removeprefix("torch.")


def checksum(
    t: torch.Tensor, chunk_bytes: int = _CHUNK_BYTES, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Position-weighted checksum of ``t``'s bytes in memory order: a 0-d int64 tensor on ``t``'s
    device (no host sync). Contiguous layout: a view is checksummed in its logical order.

    Byte ``i`` weighs ``1 + i mod 65521``, so the bytes are summed per weight first: seen as rows of
    65521 bytes, column ``j`` of every row weighs ``j + 1``, and the sum is ``sum_j (j + 1) *
    colsum_j``, one multiply per column instead of an int64 product (and modulo) per byte: the
    same integer. The column sums run ``chunk_bytes`` of rows at a time in int32 (a chunk's column
    sum is at most 255 x rows < 2^31), so temporaries stay bounded; on CPU through numpy, whose
    uint8 -> int32 reduce ran 0.7 GB/s on one thread where torch's ran 0.1. Measured on 56 MB
    (SmolLM2's embedding in BF16), 2 shared cores: 7.8 s for the per-byte form this replaced.

    ``weight``: :func:`position_weights` on ``t``'s device, made once for many calls. A tensor
    shorter than 65521 bytes (scales, norms) is its tail alone: three kernels with ``weight``."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [n]
    rows = flat.numel() // _MODULUS
    weight = position_weights(flat.device) if weight is None else weight  # [M]: 1 + (i mod M)
    tail = flat[rows * _MODULUS :]  # [< M]: the last, partial row
    tail_sum = (tail.to(torch.int64) * weight[: tail.numel()]).sum()
    if rows == 0:
        return tail_sum
    cols = torch.zeros(_MODULUS, dtype=torch.int64, device=flat.device)  # [M]
    full = flat[: rows * _MODULUS].view(rows, _MODULUS)  # [rows, M]
    step = min(max(1, chunk_bytes // _MODULUS), 2**31 // 256)
    for r in range(0, rows, step):
        part = full[r : r + step]
        if part.device.type == "cpu":  # numpy's widening reduce: ~7x torch's on CPU (1 thread)
            cols += torch.from_numpy(np.add.reduce(part.numpy(), axis=0, dtype=np.int32))
        else:
            cols += part.sum(0, dtype=torch.int32)
    return (cols * weight).sum() + tail_sum


def position_weights(device: torch.device) -> torch.Tensor:
    """``[65521]`` int64 on ``device``: ``1 + j``, the weight of a byte at ``j`` modulo 65521."""
    return torch.arange(1, _MODULUS + 1, device=device, dtype=torch.int64)


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """:func:`checksum` of each tensor (possibly on several devices), read back in one transfer per
    device. On CUDA with ``FP8RL_CHECKSUM=triton``, a device's tensors are summed in one launch
    (:mod:`workers.weight_sync.triton_checksum`) instead of ~10 kernels each."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = [0] * len(tensors)
    for device, indices in by_device.items():
        if batched_checksums(device):
            from workers.weight_sync.triton_checksum import checksum_many

            sums = checksum_many([tensors[i] for i in indices])
        else:
            weight = position_weights(device)
            sums = torch.stack([checksum(tensors[i], weight=weight) for i in indices])
        for i, x in zip(indices, sums.tolist(), strict=True):
            out[i] = int(x)
    return out


def batched_checksums(device: torch.device) -> bool:
    """``FP8RL_CHECKSUM=triton``: a report's checksums in one Triton launch per CUDA device (or on
    the CPU under Triton's interpreter, for tests); ``torch`` (the default until a GPU has run it):
    :func:`checksum` tensor by tensor. Read at each report."""
    return triton_switch("FP8RL_CHECKSUM", "torch", "triton", device, "one checksum per tensor (torch)")


def kv_dtype_name(name: str) -> str:
    """The element dtype of a KV cache named ``name``: vLLM's ``fp8`` / ``fp8_e4m3`` are
    ``float8_e4m3fn``, ``fp8_e5m2`` is ``float8_e5m2``; a dtype name stays as it is."""
    return _KV_CACHE_ALIASES.get(name, name.removeprefix("torch."))


def is_kv_scale(name: str) -> bool:
    """Whether ``name`` is a K/V-cache scale (:func:`workers.fp8.kv_cache.kv_scale_name`)."""
    return _KV_SCALE.match(name) is not None


def received_weights(
    payload: Mapping[str, Fp8Tensor | torch.Tensor], holds: Mapping[str, str]
) -> dict[str, HeldWeight]:
    """The :class:`HeldWeight` entries of ``payload`` (the bytes as they travelled), with the
    precision each layer computes with from ``holds`` (name -> ``fp8`` | dtype name; a name
    missing there is reported as ``missing``: the receiver did not load it). K/V-cache scales
    are left out: they are checked through :class:`KvHeld`."""
    names, kinds, summed = [], [], []  # summed: each name's tensors (data, and an FP8 weight's scales)
    for name, value in payload.items():
        if is_kv_scale(name):
            continue
        names.append(name)
        if isinstance(value, Fp8Tensor):
            kinds.append(dtype_name(value.data.dtype))
            summed.append([value.data, value.scale.to(torch.float32)])
        else:
            kinds.append(dtype_name(value.dtype))
            summed.append([value])
    values = iter(checksums([t for ts in summed for t in ts]))
    sums = [[next(values) for _ in ts] for ts in summed]
    return {
        name: HeldWeight(
            dtype=kind, holds=holds.get(name, "missing"), data=s[0], scale=s[1] if len(s) > 1 else 0
        )
        for name, kind, s in zip(names, kinds, sums, strict=True)
    }


def sent_report(payload: Mapping[str, Fp8Tensor | torch.Tensor], kv_dtype: str) -> WeightReport:
    """The trainer's side: what it sent (FP8 entries ``holds`` ``fp8``, others their own dtype)
    and the KV cache it expects (``kv_dtype``: the generator's cache dtype under the spec, and the
    K/V scales the payload carries)."""
    holds = {n: "fp8" if isinstance(v, Fp8Tensor) else dtype_name(v.dtype) for n, v in payload.items()}
    k_scales, v_scales = kv_scales_of(payload)
    return WeightReport(
        weights=received_weights(payload, holds),
        kv=KvHeld(dtype=kv_dtype, k_scales=k_scales, v_scales=v_scales),
    )


def kv_scale_tensors(payload: Mapping[str, Fp8Tensor | torch.Tensor]) -> torch.Tensor | None:
    """The K and V scales a payload carries, as one float32 ``[2, layers]`` tensor (K, then V) on
    the payload's device, without reading them back; None when it carries none."""
    found: dict[tuple[str, int], torch.Tensor] = {}
    for name, value in payload.items():
        match = _KV_SCALE.match(name)
        if match and isinstance(value, torch.Tensor):
            found[(match.group(2), int(match.group(1)))] = value.reshape(()).to(torch.float32)
    if not found:
        return None
    layers = 1 + max(i for _, i in found)
    missing = [f"{w}_scale of layer {i}" for w in "kv" for i in range(layers) if (w, i) not in found]
    if missing:
        raise ValueError(
            f"weight sync: the payload's K/V scales are incomplete: missing {', '.join(missing[:4])}"
        )
    device = found[("k", 0)].device
    return torch.stack([found[(w, i)].to(device) for w in "kv" for i in range(layers)]).view(2, layers)


def kv_scales_of(payload: Mapping[str, Fp8Tensor | torch.Tensor]) -> tuple[list[float], list[float]]:
    """The K and V scales a payload carries, by layer (empty lists when it carries none), read
    back in one transfer."""
    both = kv_scale_tensors(payload)
    if both is None:
        return [], []
    k, v = both.tolist()
    return [float(x) for x in k], [float(x) for x in v]


def _fp8(kind: str) -> bool:
    return kind == "fp8" or kind.startswith("float8")


def compare(sent: WeightReport, held: WeightReport) -> ContractCheck:
    """Every weight the trainer sent against what the generator reports (see the module docstring).

    A mismatch is: a weight not reported or reported but not sent; a different dtype on the wire
    or different checksums (the bytes changed on the way); a weight sent in FP8 held in high
    precision (a silent fallback) or sent in high precision held in FP8 (quantized by the
    generator itself); a KV cache in another dtype than the spec's (vLLM's ``fp8`` is E4M3, so
    an E5M2 cache differs from it: :func:`kv_dtype_name`); K/V scales other than those sent, bit
    for bit as float32."""
    out = ContractCheck(checked=len(sent["weights"]))
    got = held["weights"]
    for name, s in sent["weights"].items():
        h = got.get(name)
        if h is None or h["holds"] == "missing":
            out.mismatches.append(f"{name}: sent, but the generator did not load it")
            continue
        if h["dtype"] != s["dtype"]:
            out.mismatches.append(f"{name}: sent as {s['dtype']}, received as {h['dtype']}")
        elif (h["data"], h["scale"]) != (s["data"], s["scale"]):
            what = "data" if h["data"] != s["data"] else "scales"
            out.mismatches.append(f"{name}: the received {what} differ from the sent bytes (checksum)")
        if _fp8(s["holds"]) and not _fp8(h["holds"]):
            out.mismatches.append(
                f"{name}: sent as FP8 (data + scales), but the generator computes with {h['holds']}: "
                "a silent high-precision fallback"
            )
        elif not _fp8(s["holds"]) and _fp8(h["holds"]):
            out.mismatches.append(
                f"{name}: sent as {s['holds']}, but the generator holds it in FP8: it quantized the "
                "weight itself instead of using the trainer's"
            )
    for name in sorted(got.keys() - sent["weights"].keys()):
        out.mismatches.append(f"{name}: the generator reports it, but the trainer did not send it")
    skv, hkv = sent["kv"], held["kv"]
    if kv_dtype_name(skv["dtype"]) != kv_dtype_name(hkv["dtype"]):
        out.mismatches.append(
            f"KV cache: the spec asks for {skv['dtype']}, the generator holds {hkv['dtype']}"
        )
    for which, want, have in (
        ("k", skv["k_scales"], hkv["k_scales"]),
        ("v", skv["v_scales"], hkv["v_scales"]),
    ):
        if not want:
            continue
        if len(have) != len(want):
            out.mismatches.append(
                f"KV cache: {which}_scale of {len(want)} layers sent, the generator holds {len(have)}"
            )
            continue
        for i, (sent_scale, held_scale) in enumerate(zip(want, have, strict=True)):
            if torch.tensor(sent_scale, dtype=torch.float32) != torch.tensor(held_scale, dtype=torch.float32):
                out.mismatches.append(
                    f"KV cache: layer {i} {which}_scale sent {sent_scale!r}, held {held_scale!r}"
                )
    return out
