"""The vLLM weight transfer of layers whose widths are not multiples of 128 (SmolLM2: hidden 576 =
4.5 blocks, intermediate 1536), into vLLM's own block-FP8 linear layers.

The payload goes the way :class:`ChannelTransferEngine` takes it in a worker (the channel's
result, checksums, :func:`checkpoint_tensors`, the model's ``load_weights``); the model here holds
real vLLM 0.32 layers (``RowParallelLinear``, ``MergedColumnParallelLinear`` with ``Fp8Config``
128x128 blocks) built on one CPU rank, whose parameters and weight loaders are vLLM's. What vLLM
holds after the load is checked against the trainer's bytes and scales and, dequantized as vLLM's
block kernels read it (each scale over its 128x128 block, the last one partial), against the
master weights within the E4M3 bound of ``tests/workers/fp8/reference.py``.

Needs vllm (``make engines``); without it the module fails to import, as the other vLLM tests.
It also needs Intel AMX, and skips without it (below). What it checks of our side holds on every
CPU elsewhere: the ceil scale grids of partial blocks and their dequantization within the FP8
bound (tests/workers/fp8/test_hf_checkpoint.py::test_partial_blocks_export_with_ceil_scale_grids_and
_dequantize_within_fp8_error), and the product's refusal of a job that needs these layers on a
CPU without AMX (test_config.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import (
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization.fp8 import Fp8Config

from tests.workers.fp8 import reference as ref
from workers.engines.vllm.config import CpuFeatures
from workers.engines.vllm.transfer import ChannelTransferEngine, ChannelUpdateInfo

if not CpuFeatures.detect().amx:
    # vLLM 0.32's CPU block-FP8 linears have no kernel without AMX: the layers this test loads into
    # cannot be built (the product refuses such a job on such a CPU: test_config.py)
    pytest.skip(
        "vLLM's CPU block-FP8 linear layers need Intel AMX (Sapphire Rapids or newer), which this CPU lacks",
        allow_module_level=True,
    )
from workers.fp8 import Fp8Tensor, quantize
from workers.fp8.hf_checkpoint import check_tp_partitions
from workers.weight_sync.data import SyncResult

HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M
PREFIX = "model.layers.0"


@pytest.fixture(scope="module")
def vllm_rank() -> Iterator[VllmConfig]:
    """vLLM's tensor-parallel state for one CPU rank (gloo), torn down after the module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = VllmConfig()
    # Fp8LinearMethod reads the model's dtype; model parallelism whether it is a MoE
    object.__setattr__(config, "model_config", SimpleNamespace(dtype=torch.bfloat16, is_moe=False))
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def fp8_config() -> Fp8Config:
    """What vLLM builds from fp8rl's quantization_config: serialized E4M3, 128x128, dynamic."""
    return Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128]
    )


class VllmMlpAndOProj(nn.Module):
    """A vLLM Llama layer's o_proj and gate_up_proj, loading as ``LlamaModel.load_weights`` does:
    ``gate_proj``/``up_proj`` go into ``gate_up_proj`` as shards 0 and 1; returns the names loaded."""

    def __init__(self) -> None:
        super().__init__()
        q = fp8_config()
        self.o_proj = RowParallelLinear(HIDDEN, HIDDEN, bias=False, quant_config=q, prefix=f"{PREFIX}.o_proj")
        self.down_proj = RowParallelLinear(
            INTERMEDIATE, HIDDEN, bias=False, quant_config=q, prefix=f"{PREFIX}.down_proj"
        )
        self.gate_up_proj = MergedColumnParallelLinear(
            HIDDEN, [INTERMEDIATE] * 2, bias=False, quant_config=q, prefix=f"{PREFIX}.gate_up_proj"
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix(f"{PREFIX}.self_attn.").removeprefix(f"{PREFIX}.mlp.")
            shard = {"gate_proj": 0, "up_proj": 1}.get(name.split(".")[0])
            if shard is not None:
                name = name.replace(name.split(".")[0], "gate_up_proj")
                params[name].weight_loader(params[name], tensor, shard)  # type: ignore[attr-defined]
            else:
                params[name].weight_loader(params[name], tensor)  # type: ignore[attr-defined]
            loaded.add(name)
        return loaded


class OneUpdate:
    """A weight channel that hands over one payload (what trainer 0 would send)."""

    def __init__(self, payload: dict[str, Fp8Tensor | torch.Tensor]) -> None:
        self.payload = payload

    def sync_weights(self, _: Any) -> SyncResult:
        return SyncResult(version=1, bytes=0, seconds=0.0, buckets=1, payload=dict(self.payload))


def receive(model: nn.Module, payload: dict[str, Fp8Tensor | torch.Tensor]) -> ChannelTransferEngine:
    """``ChannelTransferEngine.receive_weights`` on ``model`` (no vLLM engine around it)."""
    engine = object.__new__(ChannelTransferEngine)  # its __init__ needs a running worker's config
    engine.model = model
    engine.channel = OneUpdate(payload)  # type: ignore[assignment]
    engine.attention = SimpleNamespace(scales_sent=False, loads_scales=False)  # type: ignore[assignment]
    engine._kv = {}
    engine.receive_weights(ChannelUpdateInfo(version=1))
    return engine


def block_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight.float() times the scale of its 128x128 block, as vLLM's block-FP8 GEMMs read them
    (an index computation, not repeat_interleave: row r, column c use scale[r // 128, c // 128])."""
    rows = torch.arange(weight.shape[0]) // 128
    cols = torch.arange(weight.shape[1]) // 128
    return weight.double() * scale.double()[rows][:, cols]


def test_a_576_wide_layers_payload_lands_in_vllms_block_fp8_parameters(
    vllm_rank: VllmConfig, seed: int
) -> None:
    masters = {
        f"{PREFIX}.self_attn.o_proj.weight": torch.randn(HIDDEN, HIDDEN) * 0.05,  # partial on N and K
        f"{PREFIX}.mlp.down_proj.weight": torch.randn(HIDDEN, INTERMEDIATE) * 0.05,  # partial on N
        f"{PREFIX}.mlp.gate_proj.weight": torch.randn(INTERMEDIATE, HIDDEN) * 0.05,  # partial on K
        f"{PREFIX}.mlp.up_proj.weight": torch.randn(INTERMEDIATE, HIDDEN) * 0.05,
    }
    for w in masters.values():
        w[-1, -1] = 0.9  # the last, partial block's amax: its scale differs from its neighbours'
    payload: dict[str, Fp8Tensor | torch.Tensor] = {
        n: quantize(w, "e4m3", (128, 128)) for n, w in masters.items()
    }
    with set_current_vllm_config(vllm_rank):
        model = VllmMlpAndOProj()
    # vLLM's own parameter shapes: ceil(N/128) x ceil(K/128) scales
    assert tuple(model.o_proj.weight_scale_inv.shape) == (5, 5)
    assert tuple(model.down_proj.weight_scale_inv.shape) == (5, 12)
    assert tuple(model.gate_up_proj.weight_scale_inv.shape) == (24, 5)
    engine = receive(model, payload)
    assert engine._loaded == {"o_proj.weight", "o_proj.weight_scale_inv", "down_proj.weight"} | {
        "down_proj.weight_scale_inv",
        "gate_up_proj.weight",
        "gate_up_proj.weight_scale_inv",
    }
    held = {
        "o_proj": (model.o_proj.weight, model.o_proj.weight_scale_inv, "self_attn.o_proj"),
        "down_proj": (model.down_proj.weight, model.down_proj.weight_scale_inv, "mlp.down_proj"),
        "gate_proj": (
            model.gate_up_proj.weight[:INTERMEDIATE],
            model.gate_up_proj.weight_scale_inv[:12],
            "mlp.gate_proj",
        ),
        "up_proj": (
            model.gate_up_proj.weight[INTERMEDIATE:],
            model.gate_up_proj.weight_scale_inv[12:],
            "mlp.up_proj",
        ),
    }
    for short, (weight, scale, path) in held.items():
        name = f"{PREFIX}.{path}.weight"
        sent = payload[name]
        assert isinstance(sent, Fp8Tensor)
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, short
        assert torch.equal(weight.data.view(torch.uint8), sent.data.view(torch.uint8)), short  # the bytes
        assert torch.equal(scale.data, sent.scale), short  # the partial blocks' scales included
        master = masters[name]
        assert scale[-1, -1].item() == pytest.approx(0.9 / 448, rel=2**-23), short
        err = (block_dequantize(weight.data, scale.data) - master.double()).abs()
        assert bool((err <= ref.error_bound(master, (128, 128), "e4m3")).all()), short


def test_q_k_v_of_576_and_192_rows_cannot_share_vllms_fused_scale_grid(vllm_rank: VllmConfig) -> None:
    # Why fp8rl keeps such q/k/v in BF16 for vLLM (check_layout): vLLM fuses them into one weight
    # of 576 + 192 + 192 = 960 rows with ceil(960/128) = 8 scale rows, while q, k and v quantized on
    # their own have ceil(576/128) + 2 * ceil(192/128) = 5 + 2 + 2 = 9: q's last, partial block
    # (rows 512-575) and k's first rows would have to share one scale row.
    with set_current_vllm_config(vllm_rank):
        qkv = QKVParallelLinear(
            HIDDEN, 64, 9, 3, bias=False, quant_config=fp8_config(), prefix=f"{PREFIX}.qkv_proj"
        )
    assert tuple(qkv.weight_scale_inv.shape) == (8, 5)
    with pytest.raises(ValueError, match=r"q_proj: its output size 576 .* not a multiple of 128"):
        check_tp_partitions({f"{PREFIX}.self_attn.q_proj.weight": (576, 576)}, 1)
    # o_proj (576 x 576), down_proj (576 x 1536) and gate/up (1536 x 576) load whole (test above)
    check_tp_partitions(
        {
            f"{PREFIX}.self_attn.o_proj.weight": (576, 576),
            f"{PREFIX}.mlp.down_proj.weight": (576, 1536),
            f"{PREFIX}.mlp.gate_proj.weight": (1536, 576),
        },
        1,
    )
