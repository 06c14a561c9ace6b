"""The precision contract of a weight sync (workers/weight_sync/contract.py).

The checksum is ``sum(byte_i * (1 + i mod 65521))`` over a tensor's bytes in memory order; the
expected values below are worked out by hand from the bytes, or by a plain Python loop over
``bytes(...)`` (a second implementation that shares nothing with the torch one).
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch

from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.kv_cache import kv_scale_name
from workers.fp8.quant import quantize
from workers.weight_sync.contract import (
    checksum,
    compare,
    kv_dtype_name,
    kv_scales_of,
    received_weights,
    sent_report,
)
from workers.weight_sync.data import KvHeld, Payload, WeightReport


def python_checksum(data: bytes) -> int:
    return sum(b * (1 + i % 65521) for i, b in enumerate(data))


def test_checksum_by_hand() -> None:
    # bytes 1, 2, 3 weighted 1, 2, 3: 1 + 4 + 9
    assert int(checksum(torch.tensor([1, 2, 3], dtype=torch.uint8))) == 14
    # a bfloat16 1.0 is the bytes 0x80, 0x3F: 128 * 1 + 63 * 2
    assert int(checksum(torch.ones(1, dtype=torch.bfloat16))) == 254
    # float32 1.0 is 00 00 80 3f in memory (little endian): 0x80 * 3 + 0x3f * 4 = 384 + 252
    assert int(checksum(torch.tensor([1.0], dtype=torch.float32))) == 636


def test_checksum_weights_wrap_at_the_modulus() -> None:
    # 65522 bytes of 1: weights 1..65521, then 1 again
    ones = torch.ones(65522, dtype=torch.uint8)
    assert int(checksum(ones)) == 65521 * 65522 // 2 + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_checksum_matches_a_python_loop_in_any_chunking(dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(37, 29, generator=g) * 3).to(dtype)
    want = python_checksum(t.view(torch.uint8).numpy().tobytes())
    for chunk in (1, 7, 64, 1 << 24):
        assert int(checksum(t, chunk_bytes=chunk)) == want


def test_checksum_sees_reordered_bytes_and_logical_order() -> None:
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert int(checksum(t)) != int(checksum(t.flip(0)))  # same bytes, other order
    # a transposed view is checksummed in its logical (row-major) order, as .contiguous() lays it out
    assert int(checksum(t.t())) == python_checksum(struct.pack("<4f", 1.0, 3.0, 2.0, 4.0))


def test_checksum_on_meta_tensors_never_reads_data() -> None:
    # meta tensors have no data: anything that would wait for a GPU raises here
    out = checksum(torch.empty(1000, 130, dtype=torch.bfloat16, device="meta"), chunk_bytes=4096)
    assert out.device.type == "meta" and out.dtype == torch.int64 and out.shape == ()


def _payload(seed: int, layers: int = 2) -> Payload:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 128, generator=g)
    payload: Payload = {
        "model.layers.0.mlp.down_proj.weight": quantize(w, "e4m3", (128, 128)),
        "model.norm.weight": torch.randn(128, generator=g).to(torch.bfloat16),
    }
    for i in range(layers):
        payload[kv_scale_name(i, "k")] = torch.tensor(0.01 * (i + 1))
        payload[kv_scale_name(i, "v")] = torch.tensor(0.02 * (i + 1))
    return payload


def test_sent_report_names_each_weight_with_its_bytes(seed: int) -> None:
    payload = _payload(seed)
    report = sent_report(payload, "float8_e4m3fn")
    fp8 = payload["model.layers.0.mlp.down_proj.weight"]
    norm = payload["model.norm.weight"]
    assert set(report["weights"]) == {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}
    down = report["weights"]["model.layers.0.mlp.down_proj.weight"]
    assert down["dtype"] == "float8_e4m3fn" and down["holds"] == "fp8"
    assert down["data"] == python_checksum(fp8.data.view(torch.uint8).numpy().tobytes())
    assert down["scale"] == python_checksum(fp8.scale.float().numpy().tobytes())
    n = report["weights"]["model.norm.weight"]
    assert n == {
        "dtype": "bfloat16",
        "holds": "bfloat16",
        "data": python_checksum(norm.view(torch.uint8).numpy().tobytes()),
        "scale": 0,
    }
    # float32 K/V scales, as the payload carries them
    assert report["kv"]["k_scales"] == [torch.tensor(0.01).item(), torch.tensor(0.02).item()]
    assert report["kv"]["v_scales"] == [torch.tensor(0.02).item(), torch.tensor(0.04).item()]


def _held(payload: Payload, **holds: str) -> WeightReport:
    names = {"down": "model.layers.0.mlp.down_proj.weight", "norm": "model.norm.weight"}
    held = {"model.layers.0.mlp.down_proj.weight": "fp8", "model.norm.weight": "bfloat16"}
    held.update({names[k]: v for k, v in holds.items()})
    k, v = kv_scales_of(payload)
    return WeightReport(
        weights=received_weights(payload, held),
        kv=KvHeld(dtype="float8_e4m3fn", k_scales=k, v_scales=v),
    )


def test_what_was_sent_and_held_alike_passes(seed: int) -> None:
    payload = _payload(seed)
    check = compare(sent_report(payload, "float8_e4m3fn"), _held(payload))
    assert check.ok and check.checked == 2
    check.raise_if_failed()


def test_a_silent_bf16_fallback_is_named(seed: int) -> None:
    payload = _payload(seed)
    check = compare(sent_report(payload, "float8_e4m3fn"), _held(payload, down="bfloat16"))
    assert check.mismatches == [
        "model.layers.0.mlp.down_proj.weight: sent as FP8 (data + scales), but the generator computes "
        "with bfloat16: a silent high-precision fallback"
    ]
    with pytest.raises(RuntimeError, match="1 of 2 weights differ"):
        check.raise_if_failed()


def test_a_weight_the_generator_quantized_itself_is_named(seed: int) -> None:
    payload = _payload(seed)
    check = compare(sent_report(payload, "float8_e4m3fn"), _held(payload, norm="fp8"))
    assert len(check.mismatches) == 1 and "quantized the weight itself" in check.mismatches[0]


def test_changed_bytes_missing_and_unexpected_weights_are_named(seed: int) -> None:
    payload = _payload(seed)
    sent = sent_report(payload, "float8_e4m3fn")
    corrupted = dict(payload)
    fp8 = payload["model.layers.0.mlp.down_proj.weight"]
    scale = fp8.scale.clone()
    scale[0, 0] *= 2  # one block's scale doubled
    corrupted["model.layers.0.mlp.down_proj.weight"] = Fp8Tensor(fp8.data, scale, fp8.block, fp8.fmt)
    held = _held(corrupted)
    assert compare(sent, held).mismatches == [
        "model.layers.0.mlp.down_proj.weight: the received scales differ from the sent bytes (checksum)"
    ]
    held = _held(payload, norm="missing")
    held["weights"]["lm_head.weight"] = held["weights"]["model.norm.weight"]
    assert compare(sent, held).mismatches == [
        "model.norm.weight: sent, but the generator did not load it",
        "lm_head.weight: the generator reports it, but the trainer did not send it",
    ]


def test_kv_cache_dtype_and_scales_must_be_the_sent_ones(seed: int) -> None:
    payload = _payload(seed)
    sent = sent_report(payload, "float8_e4m3fn")
    held = _held(payload)
    held["kv"] = KvHeld(dtype="bfloat16", k_scales=[1.0, 1.0], v_scales=held["kv"]["v_scales"])
    assert compare(sent, held).mismatches == [
        "KV cache: the spec asks for float8_e4m3fn, the generator holds bfloat16",
        f"KV cache: layer 0 k_scale sent {sent['kv']['k_scales'][0]!r}, held 1.0",
        f"KV cache: layer 1 k_scale sent {sent['kv']['k_scales'][1]!r}, held 1.0",
    ]
    held["kv"] = KvHeld(dtype="float8_e4m3fn", k_scales=[], v_scales=[])  # scales never applied
    assert compare(sent, held).mismatches == [
        "KV cache: k_scale of 2 layers sent, the generator holds 0",
        "KV cache: v_scale of 2 layers sent, the generator holds 0",
    ]


def test_incomplete_kv_scales_are_refused() -> None:
    payload = {kv_scale_name(0, "k"): torch.tensor(1.0), kv_scale_name(1, "k"): torch.tensor(1.0)}
    with pytest.raises(ValueError, match="missing v_scale of layer 0, v_scale of layer 1"):
        kv_scales_of(payload)


@pytest.mark.parametrize(
    "kept", [{"keep_bf16_layers": [1, 0]}, {"bf16_layers": [0]}], ids=["first", "by-index"]
)
@pytest.mark.parametrize("recipe", ["bf16", "fp8-gen", "fp8-e2e"])
def test_the_native_generator_reports_what_it_loaded(recipe: str, kept: dict[str, Any]) -> None:
    """A real native trainer/generator pair: the generator's report after loading the trainer's
    payload passes the contract, and its FP8 layers say ``fp8`` (the audit's FP8 rows); layer 0
    kept in BF16 as the first layer or by index (``precision.bf16_layers``, the path of the
    mismatch SLO's bf16-layers action) is BF16 in both engines."""
    from rljob.spec import JobSpec
    from tests.helpers import TWO_LAYER_MODEL, tiny_spec
    from workers.engines.factory import native_trainer
    from workers.engines.native.generator import NativeGenerator
    from workers.weight_sync.payload import fp8_weight_names

    spec = JobSpec.model_validate(
        tiny_spec(model={"tiny": TWO_LAYER_MODEL}, precision={"recipe": recipe, **kept})
    )
    trainer = native_trainer(spec, 64)
    gen = NativeGenerator(spec, 64, 1, 0)
    payload = trainer.export_weights(fp8_weight_names(gen.model))
    gen.load_weights(payload)
    held = gen.weight_report()
    check = compare(sent_report(payload, "bfloat16"), held)
    assert check.ok, check.mismatches
    assert check.checked == len(dict(gen.model.named_parameters())) == len(payload)
    fp8_rows = {f"{r.name}.weight" for r in gen.audit.rows if r.precision == "fp8"}
    assert {n for n, w in held["weights"].items() if w["holds"] == "fp8"} == fp8_rows
    assert len(fp8_rows) == (0 if recipe == "bf16" else 7)  # layer 1's seven linears
    assert all(".layers.1." in n for n in fp8_rows)
    if recipe == "fp8-e2e":  # the trainer holds the same layers in FP8
        trained = {f"{r.name}.weight" for r in trainer.audit.rows if r.precision == "fp8"}
        assert {n.removeprefix("model.") for n in trained} == {n.removeprefix("model.") for n in fp8_rows}


def _report(kv_dtype: str) -> WeightReport:
    return WeightReport(weights={}, kv=KvHeld(dtype=kv_dtype, k_scales=[], v_scales=[]))


def test_kv_cache_dtypes_compare_by_format() -> None:
    assert kv_dtype_name("fp8") == kv_dtype_name("fp8_e4m3") == "float8_e4m3fn"
    assert kv_dtype_name("fp8_e5m2") == "float8_e5m2" and kv_dtype_name("torch.bfloat16") == "bfloat16"
    assert compare(_report("fp8"), _report("float8_e4m3fn")).ok
    assert compare(_report("bfloat16"), _report("bfloat16")).ok
    # an E5M2 cache is FP8 too, but not the format the spec asks for
    assert compare(_report("fp8"), _report("float8_e5m2")).mismatches == [
        "KV cache: the spec asks for fp8, the generator holds float8_e5m2"
    ]
    assert not compare(_report("float8_e4m3fn"), _report("bfloat16")).ok
