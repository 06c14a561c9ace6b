"""A decode step of the native generator's CUDA loop, run on a CPU with fake CUDA tensors
(tests/workers/fake_cuda.py): what it launches, counted against a count worked out by hand, and
no read back to the host before the generate has issued all of its work (the finite guards' reads
come last).

The step is the one the CUDA graph captures (the static loop, run eagerly here: capture needs a
GPU). It is counted as the launches of a 3-token generate less those of a 2-token one, at two and
three layers of the 1B preset's shapes (hidden 2048, MLP 8192, 16/8 heads of 128), so that one
layer's share is their difference. With every decode switch on, a decoder layer should be its
GEMMs and these Triton launches, and nothing else:
- two RMSNorms (input, post-attention; each layer's adds run inside them);
- RoPE of q and k with the K/V write (one launch, either cache);
- the decode attention (one key range at these lengths: no combine launch);
- for FP8 weights, the SiLU*mul with down_proj's quantizer, and o_proj's input quantizer (q/k/v
  and gate/up read the tiles their norm wrote).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from bench.common import MODELS
from rljob import parse_spec
from tests.workers.fake_cuda import CUDA, Launches, added, build_on_fake_cuda, fake_cuda
from workers.fp8 import simulate

# Fp8Linear's weight key reads the weight's data pointer, which a fake tensor warns about
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

SWITCHES = ("FP8RL_DECODE_ATTENTION", "FP8RL_KV_WRITE", "FP8RL_SILU_MUL", "FP8RL_RMS_NORM", "FP8RL_SAMPLING")
VOCAB = 32768
NORM, ROPE_WRITE, ATTENTION = "_rms_norm", "_rope_write_kv", "_split_kernel"
SAMPLING = {"_range_stats": 1, "_range_pick": 1, "_finish": 1}
PER_LAYER = {
    # (triton launches, other kernels) of one layer's decode step
    "bf16": ({NORM: 2, ROPE_WRITE: 1, ATTENTION: 1}, {"mm": 7, "silu": 1, "mul": 1}),
    "fp8-e2e": (
        {NORM: 2, ROPE_WRITE: 1, ATTENTION: 1, "_silu_mul_1x128": 1, "_quantize_1x128": 1},
        {"_scaled_mm_v2": 4},
    ),
}


def step_launches(monkeypatch: pytest.MonkeyPatch, recipe: str, kv: bool, layers: int) -> Launches:
    """One decode step's launches: a 3-token generate's less a 2-token one's. Each generate's
    reads back to the host (the finite guards' codes) must come after its last launch."""
    from workers.engines.native import generator
    from workers.fp8 import guard

    with simulate("sm90-cuda13.0"), fake_cuda(monkeypatch) as (mode, launches):
        reads: list[int] = []  # the launches issued before each read
        monkeypatch.setattr(guard.FiniteGuard, "check", lambda self: reads.append(launches.total))
        build_on_fake_cuda(monkeypatch, mode, generator)
        shape = {**MODELS["1b"], "num_layers": layers, "max_position_embeddings": 256}
        precision = {"recipe": recipe, "fp8_kv_cache": kv}
        spec = parse_spec({"model": {"tiny": shape}, "precision": precision, "rollout": {"decode": "graph"}})
        gen = generator.NativeGenerator(spec, VOCAB, 1, 0, "cuda")
        assert gen.static is not None
        gen.static.use_graphs = False  # the step a graph captures, issued eagerly
        ids = torch.randint(0, VOCAB, (64, 16), device=CUDA)
        attn = torch.ones(64, 16, dtype=torch.long, device=CUDA)
        counts: list[tuple[Counter[str], Counter[str]]] = []
        for new_tokens in (2, 3):
            launches.clear()
            reads.clear()
            with launches:
                tokens, _, _ = gen.generate_on_device(ids, attn, new_tokens, 1.0, 1.0, 0)
            assert tokens.shape == (64, new_tokens)
            # the prefill's guard and the loop's, both read once everything is issued
            assert reads == [launches.total] * 2, (reads, launches.total)
            counts.append((Counter(launches.triton), Counter(launches.aten)))
    step = Launches()
    step.triton, step.aten = added(counts[0][0], counts[1][0]), added(counts[0][1], counts[1][1])
    return step


@pytest.mark.parametrize(("recipe", "kv"), [("bf16", False), ("fp8-e2e", False), ("fp8-e2e", True)])
def test_with_every_switch_a_decode_layer_is_its_gemms_and_its_triton_launches_and_nothing_reads_back(
    monkeypatch: pytest.MonkeyPatch, recipe: str, kv: bool
) -> None:
    for name in SWITCHES:
        monkeypatch.setenv(name, "triton")
    two = step_launches(monkeypatch, recipe, kv, 2)
    three = step_launches(monkeypatch, recipe, kv, 3)
    triton, other = PER_LAYER[recipe]
    assert added(two.triton, three.triton) == triton
    assert added(two.aten, three.aten) == other
    # once per step: the final norm and the three sampling launches
    fixed = two.triton - Counter({k: 2 * v for k, v in triton.items()})
    assert dict(fixed) == {NORM: 1, **SAMPLING}


def test_the_e4m3_cache_costs_a_decode_step_no_launch_with_every_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RoPE and the K/V write are one launch for either cache, and the attention reads either:
    with every switch on, FP8 weights with the E4M3 cache launch what they launch with BF16's."""
    for name in SWITCHES:
        monkeypatch.setenv(name, "triton")
    bf16_cache = step_launches(monkeypatch, "fp8-e2e", False, 2)
    e4m3_cache = step_launches(monkeypatch, "fp8-e2e", True, 2)
    assert (bf16_cache.triton, bf16_cache.aten) == (e4m3_cache.triton, e4m3_cache.aten)


def table(layers: int = 16) -> str:
    """Launches of one decode step of the 1B preset (``layers`` layers), per recipe and cache,
    with the decode switches as they default on CUDA and all on (for docs/engines.md)."""
    rows = [
        "| weights | KV cache | switches | Triton launches | other kernels | in all |",
        "|---|---|---|---|---|---|",
    ]
    for recipe, kv in (("bf16", False), ("bf16", True), ("fp8-e2e", False), ("fp8-e2e", True)):
        for on in (False, True):
            with pytest.MonkeyPatch.context() as mp:
                for name in SWITCHES:
                    if on:
                        mp.setenv(name, "triton")
                    else:
                        mp.delenv(name, raising=False)
                step = step_launches(mp, recipe, kv, layers)
            weights, cache = "FP8" if recipe == "fp8-e2e" else "BF16", "E4M3" if kv else "BF16"
            triton, other = sum(step.triton.values()), sum(step.aten.values())
            switches = "all on" if on else "defaults"
            rows.append(f"| {weights} | {cache} | {switches} | {triton} | {other} | {triton + other} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(table())
