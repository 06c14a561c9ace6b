"""What a weight sync carries between engines, as plain data: the payload a trainer exports and a
generator loads, one sync as one end saw it, and the precision contract's report of what each
side holds. Types only: the engine protocols (:mod:`workers.engines.protocols`) use them without
importing any transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

# What a trainer exports and a generator loads: name -> Fp8Tensor (an FP8 layer's weight with its
# scales) or Tensor (everything else). One alias for the engines, the weight sync and the export.
Payload = dict[str, Any]


@dataclass
class SyncResult:
    """One sync as one end saw it: the payload (receivers), its version, bytes moved and seconds."""

    version: int
    bytes: int
    seconds: float
    buckets: int
    payload: Payload | None = None


class HeldWeight(TypedDict):
    """One weight of a report (:mod:`workers.weight_sync.contract` says what each field holds)."""

    dtype: str
    holds: str
    data: int
    scale: int


class KvHeld(TypedDict):
    """The KV cache as the generator holds it: element dtype and per-layer scales (empty lists
    when the generator calibrates its own scales per batch)."""

    dtype: str
    k_scales: list[float]
    v_scales: list[float]


class WeightReport(TypedDict):
    """What one side of a sync says about the weights of one version."""

    weights: dict[str, HeldWeight]
    kv: KvHeld
