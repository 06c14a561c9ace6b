"""The per-step weight sync's CUDA path, run on a CPU with fake CUDA tensors
(tests/workers/fake_cuda.py): what its reports launch and how often they read back to the host.

On an H200 (2026-11-28, 1B preset) the sync took 46 ms for bf16 and 89 ms for fp8-gen although
fp8-gen sends 44% fewer bytes: about 24 us per launch, and most launches were the reports'
checksums, ~10 torch kernels per tensor, and an FP8 weight is two tensors (data and scales). With
``FP8RL_CHECKSUM=triton`` a report is one Triton launch per device, whatever the model's size.
Every report reads its checksums back once, and the K/V-cache scales once.

The shapes are the 1B preset's (hidden 2048, MLP 8192, 16/8 heads of 128), at two and three layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bench.common import MODELS
from rljob import parse_spec
from tests.workers.fake_cuda import CUDA, Launches, added, build_on_fake_cuda, counting_reads, fake_cuda
from workers.fp8 import simulate
from workers.fp8.formats import get_format
from workers.fp8.kv_cache import KvScales
from workers.weight_sync.contract import kv_cache_dtype, received_weights, sent_report

VOCAB = 32768
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


def spec(layers: int, recipe: str = "fp8-e2e", kv: bool = True) -> Any:
    shape = {**MODELS["1b"], "num_layers": layers, "max_position_embeddings": 256}
    return parse_spec({"model": {"tiny": shape}, "precision": {"recipe": recipe, "fp8_kv_cache": kv}})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Launches]]:
    with simulate("sm90-cuda13.0"), fake_cuda(monkeypatch) as (mode, launches):
        yield mode, launches


def payload_of(monkeypatch: pytest.MonkeyPatch, mode: Any, layers: int) -> dict[str, Any]:
    """What an fp8-e2e trainer with calibrated K/V scales sends its generators."""
    from workers.engines.native import trainer

    build_on_fake_cuda(monkeypatch, mode, trainer)
    tr = trainer.NativeTrainer(spec(layers), VOCAB, "cuda")
    ones = torch.ones(layers, device=CUDA)
    tr.kv_scales = KvScales(ones, ones.clone(), get_format("e4m3"))
    payload = tr.export_weights()  # fp8-e2e: its own FP8 weights
    assert sum(name.endswith("_scale") for name in payload) == 2 * layers
    return payload


@pytest.mark.parametrize("layers", [2, 3])
def test_a_report_reads_back_once_and_its_kv_scales_once(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[Any, Launches], layers: int
) -> None:
    """The trainer's report of what it sent: one read of the K/V scales (all layers' at once),
    one of the checksums, whatever the number of layers."""
    mode, launches = fake
    payload = payload_of(monkeypatch, mode, layers)
    with counting_reads(monkeypatch, launches), launches:
        report = sent_report(payload, kv_cache_dtype(True))
        assert launches.reads == 2
    assert len(report["kv"]["k_scales"]) == layers and len(report["weights"]) == len(payload) - 2 * layers


@pytest.mark.parametrize("layers", [2, 3])
def test_a_generator_loads_kv_scales_without_reading_them_and_reports_in_two_reads(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[Any, Launches], layers: int
) -> None:
    """Loading keeps the K/V scales on the device (before: one read per layer and scale, and a
    copy back); the report it keeps reads the scales it holds once and the checksums once."""
    from workers.engines.native import generator

    mode, launches = fake
    payload = payload_of(monkeypatch, mode, layers)
    build_on_fake_cuda(monkeypatch, mode, generator)
    gen = generator.NativeGenerator(spec(layers), VOCAB, 1, 0, "cuda")
    with counting_reads(monkeypatch, launches), launches:
        gen.load_weights(payload)
        assert launches.reads == 2
    assert gen.kv_scales is not None and gen.kv_scales.k.is_cuda and gen.kv_scales.k.shape == (layers,)
    assert len(gen.weight_report()["kv"]["v_scales"]) == layers


def report_launches(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[Any, Launches], layers: int, switch: str
) -> Launches:
    mode, launches = fake
    monkeypatch.setenv("FP8RL_CHECKSUM", switch)
    payload = {k: v for k, v in payload_of(monkeypatch, mode, layers).items() if not k.endswith("_scale")}
    with counting_reads(monkeypatch, launches):
        launches.clear()
        with launches:
            received_weights(payload, {})
        assert launches.reads == 1
    return launches


def test_with_the_switch_a_report_is_one_triton_launch_whatever_the_model(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[Any, Launches]
) -> None:
    """``FP8RL_CHECKSUM=triton``: the table of addresses copied up, the sums' zeros, the kernel,
    and the partial sums added into place; no kernel per tensor. Without it, each tensor costs
    kernels of its own: a layer's 7 FP8 weights (data and scales) and 2 norms, 16 tensors."""
    for layers in (2, 3):
        batched = report_launches(monkeypatch, fake, layers, "triton")
        assert batched.triton == {"_checksum_many": 1}
        assert batched.aten == {"_to_copy": 1, "zeros": 1, "index_add_": 1}, batched.aten
    per_tensor = [report_launches(monkeypatch, fake, n, "torch").total for n in (2, 3)]
    assert per_tensor[1] - per_tensor[0] >= 16 * 3  # at least 3 kernels a tensor


def export_launches(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[Any, Launches], recipe: str, layers: int
) -> tuple[Counter[str], Counter[str]]:
    """The launches (torch's, Triton's) of a trainer's export for generators whose decoder linears
    are FP8."""
    from workers.engines.native import trainer

    mode, launches = fake
    build_on_fake_cuda(monkeypatch, mode, trainer)
    tr = trainer.NativeTrainer(spec(layers, recipe, kv=False), VOCAB, "cuda")
    names = [f"model.layers.{i}.{p}.weight" for i in range(layers) for p in PROJECTIONS]
    launches.clear()
    with launches:
        payload = tr.export_weights(names)
    assert all(payload[n].data.dtype == torch.float8_e4m3fn for n in names)
    return Counter(launches.aten), Counter(launches.triton)


PROJECTIONS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]


def test_an_fp8_gen_export_quantizes_every_weight_in_one_launch(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[Any, Launches]
) -> None:
    """fp8-gen (a BF16 trainer, FP8 generators) quantizes the generators' FP8 layers at every sync:
    the grouped 128x128 kernel once for all of them (before: about eight torch kernels a weight),
    and per layer only the BF16 copies of the two norms' float32 master weights, as fp8-e2e's export."""
    counts = {n: export_launches(monkeypatch, fake, "fp8-gen", n) for n in (2, 3)}
    for _, triton in counts.values():
        assert triton == {"_quantize_128x128_many": 1}
    assert added(counts[2][0], counts[3][0]) == {"_to_copy": 2}


def test_a_receiver_unpacks_without_a_kernel(
    monkeypatch: pytest.MonkeyPatch, fake: tuple[Any, Launches]
) -> None:
    """The received tensors are views of the buckets (each at a multiple of 16 bytes): unpacking
    launches nothing (before: one copy a tensor, 16 a layer), and packing one concatenation a
    bucket and the zeros the padding is cut from, once."""
    from workers.weight_sync.broadcast import DEFAULT_BUCKET_BYTES, bucket_plan, manifest_of, pack, unpack

    mode, launches = fake
    payload = payload_of(monkeypatch, mode, 2)
    manifest = manifest_of(payload)
    launches.clear()
    with launches:
        buckets = pack(payload, manifest, DEFAULT_BUCKET_BYTES)
    groups = len(bucket_plan(manifest, DEFAULT_BUCKET_BYTES))
    assert len(buckets) == groups and launches.aten == {"cat": groups, "zeros": 1}, launches.aten
    launches.clear()
    with launches:
        got = unpack(buckets, manifest, DEFAULT_BUCKET_BYTES)
    assert launches.total == 0, launches.aten
    assert list(got) == list(payload)


def sync_launches(monkeypatch: pytest.MonkeyPatch, recipe: str, layers: int) -> dict[str, int]:
    """The launches of one sync as ``bench step`` times it (the trainer's export, pack, unpack, the
    generator's load and report), by phase, for the 1B preset's shapes at ``layers`` layers."""
    from workers.engines.native import generator, trainer
    from workers.weight_sync.broadcast import DEFAULT_BUCKET_BYTES, manifest_of, pack, unpack

    out: dict[str, int] = {}
    with simulate("sm90-cuda13.0"), fake_cuda(monkeypatch) as (mode, launches):
        build_on_fake_cuda(monkeypatch, mode, trainer, generator)
        tr = trainer.NativeTrainer(spec(layers, recipe, kv=False), VOCAB, "cuda")
        gen = generator.NativeGenerator(spec(layers, recipe, kv=False), VOCAB, 1, 0, "cuda")
        names = gen.fp8_weight_names()
        with counting_reads(monkeypatch, launches):

            def phase(name: str, fn: Any) -> Any:
                launches.clear()
                with launches:
                    done = fn()
                out[name] = launches.total
                return done

            payload = phase("export", lambda: tr.export_weights(names))
            manifest = manifest_of(payload)
            buckets = phase("pack", lambda: pack(payload, manifest, DEFAULT_BUCKET_BYTES))
            received = phase("unpack", lambda: unpack(buckets, manifest, DEFAULT_BUCKET_BYTES))
            phase("load and report", lambda: gen.load_weights(received))
    return out


def table(layers: int = 16) -> str:
    """Launches of one sync of the 1B preset (``layers`` layers) per recipe, with the checksums
    tensor by tensor and in one launch (for docs/engines.md). Counted at 2 and 3 layers: the
    fixed part plus ``layers`` times one layer's."""
    rows = ["| recipe | FP8RL_CHECKSUM | export | pack | unpack | load and report | in all |"]
    rows.append("|---|---|---|---|---|---|---|")
    for recipe in ("bf16", "fp8-e2e", "fp8-gen"):
        for switch in ("torch", "triton"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FP8RL_CHECKSUM", switch)
                two, three = (sync_launches(mp, recipe, n) for n in (2, 3))
            at = {k: two[k] + (layers - 2) * (three[k] - two[k]) for k in two}
            cells = " | ".join(str(at[k]) for k in ("export", "pack", "unpack", "load and report"))
            rows.append(f"| {recipe} | {switch} | {cells} | {sum(at.values())} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(table())
