"""Block-FP8 Hugging Face checkpoints: scale layout by hand, round trips, tensor-parallel shards,
and sharded safetensors files read back with safetensors' own reader."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.workers.fp8 import reference as ref
from workers.fp8 import convert_model
from workers.fp8 import hf_checkpoint as hf
from workers.fp8.formats import E4M3
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.linear import Fp8Linear
from workers.fp8.quant import quantize
from workers.weight_sync.payload import export_weights

F8 = torch.float8_e4m3fn


def read_back(tensors: dict[str, torch.Tensor]) -> dict[str, Fp8Tensor | torch.Tensor]:
    """The checkpoint's tensors as a loader reads them: each ``X.weight`` with an
    ``X.weight_scale_inv`` is E4M3 data in 128x128 blocks with that dequantization multiplier."""
    out: dict[str, Fp8Tensor | torch.Tensor] = {}
    for name, value in tensors.items():
        scale = tensors.get(name + "_scale_inv")
        if not name.endswith("_scale_inv"):
            out[name] = value if scale is None else Fp8Tensor(value, scale, (128, 128), E4M3)
    return out


def expand(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A per-element copy of a 128x128-block scale, cut to ``shape`` (float64)."""
    full = scale.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return full[: shape[0], : shape[1]]


def test_scale_layout_worked_by_hand() -> None:
    # A [256, 384] weight is 2 x 3 blocks. Block (i, j) holds 2.0 everywhere except one element
    # of 448 * (3i + j + 1): its amax, so its scale is amax / 448 = 3i + j + 1 exactly, and every
    # other element is 2 / (3i + j + 1) in FP8.
    w = torch.full((256, 384), 2.0)
    for i in range(2):
        for j in range(3):
            w[128 * i + 5, 128 * j + 7] = 448.0 * (3 * i + j + 1)
    q = quantize(w, "e4m3", (128, 128))
    tensors = hf.checkpoint_tensors({"model.layers.0.mlp.down_proj.weight": q})
    assert list(tensors) == [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale_inv",
    ]
    weight, scale = (
        tensors["model.layers.0.mlp.down_proj.weight"],
        tensors["model.layers.0.mlp.down_proj.weight_scale_inv"],
    )
    assert weight.dtype == F8 and tuple(weight.shape) == (256, 384)
    assert scale.dtype == torch.float32
    assert scale.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # row-major over the 2 x 3 blocks
    assert weight[5, 7].item() == 448.0 and weight[128 + 5, 256 + 7].item() == 448.0
    assert weight[0, 0].item() == 2.0  # block (0, 0): 2 / 1
    assert weight[0, 128].item() == 1.0  # block (0, 1): 2 / 2
    # block (1, 2): 2 / 6 = 0.3333; E4M3 in [2^-2, 2^-1) steps by 2^-5: 0.3125, 0.34375 -> 0.34375
    assert weight[200, 300].item() == 0.34375
    # the loader's rule, weight.float() * scale over 128x128 blocks
    deq = weight.double() * expand(scale, (256, 384))
    assert deq[5, 7] == 448.0 and deq[128 + 5, 256 + 7] == 448.0 * 6
    assert deq[200, 300] == 0.34375 * 6


def test_hand_built_fp8_tensor_dequantizes_per_block() -> None:
    # data all 2.0, scales [[1, 2, 3], [4, 5, 6]]: block (i, j) dequantizes to 2 (3i + j + 1)
    data = torch.full((256, 384), 2.0).to(F8)
    scale = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    fp8 = Fp8Tensor(data, scale, (128, 128), E4M3)
    tensors = hf.checkpoint_tensors({"lin.weight": fp8})
    deq = tensors["lin.weight"].double() * expand(tensors["lin.weight_scale_inv"], (256, 384))
    for i in range(2):
        for j in range(3):
            block = deq[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            assert torch.all(block == 2.0 * (3 * i + j + 1))
    assert torch.equal(deq.float(), fp8.dequantize())


def test_round_trip_keeps_fp8_bytes_and_casts_the_rest(seed: int) -> None:
    q = quantize(torch.randn(200, 300), "e4m3", (128, 128))  # partial blocks: scale [2, 3]
    embedding = torch.randn(16, 300)
    payload: dict[str, Fp8Tensor | torch.Tensor] = {
        "model.embed_tokens.weight": embedding,
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.q_proj.bias": torch.randn(200, dtype=torch.bfloat16),
        "model.norm.weight": torch.randn(300, dtype=torch.float64),
        "model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.25, dtype=torch.bfloat16),
        "temperature": torch.tensor(0.7, dtype=torch.float64),
        "position_ids": torch.arange(4),
    }
    tensors = hf.checkpoint_tensors(payload)
    dtypes = {name: t.dtype for name, t in tensors.items()}
    assert dtypes == {
        "model.embed_tokens.weight": torch.bfloat16,
        "model.layers.0.self_attn.q_proj.weight": F8,
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.float32,
        "model.layers.0.self_attn.q_proj.bias": torch.bfloat16,
        "model.norm.weight": torch.bfloat16,
        "model.layers.0.self_attn.k_scale": torch.float32,
        "model.layers.0.self_attn.v_scale": torch.float32,
        "temperature": torch.float32,
        "position_ids": torch.int64,
    }
    assert tuple(tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == (2, 3)
    back = read_back(tensors)
    assert list(back) == [n for n in tensors if not n.endswith("_scale_inv")]
    w = back["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(w, Fp8Tensor) and w.block == (128, 128) and w.fmt.name == "e4m3"
    assert torch.equal(w.data.view(torch.uint8), q.data.view(torch.uint8))  # the bytes, unchanged
    assert torch.equal(w.scale, q.scale)
    assert torch.equal(w.dequantize(), q.dequantize())
    emb = back["model.embed_tokens.weight"]
    assert isinstance(emb, torch.Tensor)
    assert torch.equal(emb, embedding.to(torch.bfloat16))


def test_refuses_what_the_format_cannot_hold() -> None:
    w = torch.randn(256, 256)
    cases: list[tuple[str, Fp8Tensor | torch.Tensor, str]] = [
        ("a.q_proj.weight", quantize(w, "e5m2", (128, 128)), r"a\.q_proj\.weight: .*float8_e5m2.*E4M3"),
        (
            "b.q_proj.weight",
            quantize(w, "e4m3", (1, 128)),
            r"b\.q_proj\.weight: .*block is \(1, 128\).*128x128",
        ),
        ("c.q_proj.weight", quantize(w, "e4m3"), r"c\.q_proj\.weight: .*block is None"),
        ("d.q_proj.bias", quantize(w, "e4m3", (128, 128)), r"d\.q_proj\.bias: .*names ending in \.weight"),
        ("e.weight", w.to(F8), r"e\.weight: a torch.float8_e4m3fn tensor without its scales"),
    ]
    for name, value, message in cases:
        with pytest.raises(ValueError, match=message):
            hf.checkpoint_tensors({name: value})
    bad_scale = Fp8Tensor(w.to(F8), torch.ones(1, 2), (128, 128), E4M3)
    with pytest.raises(
        ValueError, match=r"f\.weight: .*scale is torch.float32 \(1, 2\).*needs float32 \(2, 2\)"
    ):
        hf.checkpoint_tensors({"f.weight": bad_scale})


def test_quantization_config_and_ignored_layers() -> None:
    class Block(nn.Module):
        def __init__(self, fp8: bool) -> None:
            super().__init__()
            self.q_proj: nn.Module = Fp8Linear(128, 128) if fp8 else nn.Linear(128, 128)
            self.norm = nn.LayerNorm(128)

    model = nn.Module()
    model.layers = nn.ModuleList([Block(False), Block(True)])
    model.lm_head = nn.Linear(128, 10)
    ignored = hf.ignored_linear_names(model)
    assert ignored == ["layers.0.q_proj", "lm_head"]
    assert hf.quantization_config(ignored) == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "ignored_layers": ["layers.0.q_proj", "lm_head"],
        "modules_to_not_convert": ["layers.0.q_proj", "lm_head"],
    }


# --- tensor parallelism --------------------------------------------------------------------------


FIX = (
    r"use a tensor_parallel_size that gives multiples of 128 if one does; else this model cannot be "
    r"FP8 on vLLM .*precision.recipe bf16, or resources.generator_engine native"
)


def test_check_tp_partitions_cases_by_hand() -> None:
    # tp 1: k_proj's 64 output rows are half a block; vLLM's fused qkv needs whole blocks per part
    small_kv = {
        "model.layers.0.self_attn.k_proj.weight": (64, 128),
        "model.layers.0.self_attn.o_proj.weight": (128, 64),
    }
    with pytest.raises(ValueError) as err:
        hf.check_tp_partitions(small_kv, 1)
    lines = str(err.value).splitlines()
    assert len(lines) == 1  # o_proj is row-parallel: nothing is split at tp 1
    assert lines[0].startswith(
        "model.layers.0.self_attn.k_proj: its output size 64 split over tensor_parallel_size 1 gives 64 "
        "per GPU, not a multiple of 128 (vLLM's block-FP8 weights need whole 128x128 blocks per GPU)"
    )
    assert re.search(FIX, lines[0])
    hf.check_tp_partitions(small_kv, 1, require_whole_blocks=False)  # the rule switched off
    # tp 2: q_proj 256 -> 128 per GPU and o_proj's 256 inputs -> 128: fine
    hf.check_tp_partitions(
        {"l.q_proj.weight": (256, 128), "l.o_proj.weight": (128, 256), "lm_head.weight": (272, 128)}, 2
    )
    shapes = {
        "l.q_proj.weight": (256, 128),  # 128 per GPU: fine
        "l.gate_proj.weight": (384, 128),  # 192 per GPU: half a block
        "l.down_proj.weight": (128, 384),  # row-parallel: 192 inputs per GPU
        "l.v_proj.weight": (128, 128),  # 64 per GPU
        "lm_head.weight": (100, 100),  # replicated: not checked
    }
    with pytest.raises(ValueError) as err:
        hf.check_tp_partitions(shapes, 2)
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["l.gate_proj", "l.down_proj", "l.v_proj"]
    assert "its output size 384 split over tensor_parallel_size 2 gives 192 per GPU" in lines[0]
    assert "its input size 384 split over tensor_parallel_size 2 gives 192 per GPU" in lines[1]
    assert "its output size 128 split over tensor_parallel_size 2 gives 64 per GPU" in lines[2]
    # tp 3 on 256 rows: not even a whole number of rows per GPU
    with pytest.raises(ValueError, match=r"l.k_proj: its output size 256 .* gives 85.33 per GPU"):
        hf.check_tp_partitions({"l.k_proj.weight": (256, 128)}, 3)


# --- files ---------------------------------------------------------------------------------------


def small_checkpoint() -> dict[str, torch.Tensor]:
    payload: dict[str, Fp8Tensor | torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(32, 256),
        "model.layers.0.self_attn.q_proj.weight": quantize(torch.randn(256, 256), "e4m3", (128, 128)),
        "model.layers.0.mlp.down_proj.weight": quantize(torch.randn(256, 384), "e4m3", (128, 128)),
        "model.layers.0.input_layernorm.weight": torch.randn(256),
        "model.norm.weight": torch.randn(256),
        "lm_head.weight": torch.randn(32, 256),
    }
    return hf.checkpoint_tensors(payload)


def test_single_file_when_small(tmp_path: Path, seed: int) -> None:
    tensors = small_checkpoint()
    files = hf.write_checkpoint(tmp_path / "m", tensors, {"model_type": "llama"})
    assert [f.name for f in files] == ["model.safetensors", "config.json"]
    back = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8), t.view(torch.uint8))
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == {"model_type": "llama"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directory left


def test_shards_and_index_cover_every_tensor_once(tmp_path: Path, seed: int) -> None:
    tensors = small_checkpoint()
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    # bytes in file order: embedding 16 KiB; q_proj 64 KiB + its scale 16; down_proj 96 KiB + 24;
    # two norms 512 each; lm_head 16 KiB. Shards of 80 KiB, a weight and its scale together:
    # [embedding] (q_proj would make it 80 KiB + 16), [q_proj], [down_proj] (alone: over the
    # limit), [norms, lm_head]
    files = hf.write_checkpoint(tmp_path / "m", tensors, {}, max_shard_bytes=80 * 1024)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert [f.name for f in shards] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes.values())
    weight_map: dict[str, str] = index["weight_map"]
    assert sorted(weight_map) == sorted(tensors)
    contents = [load_file(str(shard)) for shard in shards]
    assert [sorted(c) for c in contents] == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv"],
        ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"],
        ["lm_head.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"],
    ]
    seen: list[str] = []
    for shard, content in zip(shards, contents, strict=True):
        assert all(weight_map[k] == shard.name for k in content)
        seen += content
        for k, t in content.items():
            assert t.dtype == tensors[k].dtype
            assert torch.equal(t.view(torch.uint8), tensors[k].view(torch.uint8))
    assert sorted(seen) == sorted(tensors)  # every tensor in exactly one file


def test_tied_and_shared_tensors(tmp_path: Path) -> None:
    emb = torch.randn(32, 64, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "other": emb[:16]}
    hf.write_checkpoint(tmp_path / "tied", tensors, {"tie_word_embeddings": True})
    back = load_file(str(tmp_path / "tied" / "model.safetensors"))
    assert sorted(back) == ["model.embed_tokens.weight", "other"]  # the tied head is dropped
    assert torch.equal(back["other"], emb[:16])
    hf.write_checkpoint(tmp_path / "untied", tensors, {"tie_word_embeddings": False})
    back = load_file(str(tmp_path / "untied" / "model.safetensors"))
    assert sorted(back) == ["lm_head.weight", "model.embed_tokens.weight", "other"]
    assert torch.equal(back["lm_head.weight"], emb)


def test_refuses_a_full_directory_and_leaves_nothing_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = small_checkpoint()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match=r"full already exists and is not an empty directory"):
        hf.write_checkpoint(tmp_path / "full", tensors, {})
    (tmp_path / "empty").mkdir()
    hf.write_checkpoint(tmp_path / "empty", tensors, {})  # an empty directory is fine
    import safetensors.torch

    real = safetensors.torch.save_file
    calls: list[str] = []

    def failing_save(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        hf.write_checkpoint(tmp_path / "crash", tensors, {}, max_shard_bytes=80 * 1024)
    assert len(calls) == 2  # the first shard was written, then the second failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]  # nothing half-written


def partial_block_model(hidden: int, intermediate: int, heads: int, kv_heads: int) -> Any:
    """A one-layer Llama whose widths are not multiples of 128 (576 = 4.5 blocks: SmolLM2's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("fp8_e2e", "hidden", "intermediate", "heads", "kv_heads"),
    [
        # the trainer's own FP8 copies (fp8-e2e): layers whose dims are multiples of 16 only,
        # so 208 = 1.625 blocks rather than 200
        (True, 576, 1536, 9, 3),
        (True, 208, 400, 4, 2),
        # a high-precision trainer's weights quantized for the generator (fp8-gen), any width
        (False, 576, 1536, 9, 3),
        (False, 200, 400, 4, 2),
    ],
)
def test_partial_blocks_export_with_ceil_scale_grids_and_dequantize_within_fp8_error(
    tmp_path: Path, fp8_e2e: bool, hidden: int, intermediate: int, heads: int, kv_heads: int
) -> None:
    # Every decoder linear of the file has weight_scale_inv of shape ceil(N/128) x ceil(K/128)
    # (576 -> 5, 1536 -> 12, 192 -> 2, 200 -> 2, 400 -> 4, 100 -> 1), and weight.float() times
    # the scale of its block (the loader's rule, `expand` above) is the master weight within the
    # E4M3 bound of reference.py, written from the format's definition.
    model = partial_block_model(hidden, intermediate, heads, kv_heads)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    linears = [
        n + ".weight" for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n
    ]
    if fp8_e2e:
        convert_model(model, "fp8-e2e")
        fp8_names = [n for n in linears if all(d % 16 == 0 for d in masters[n].shape)]
        payload = export_weights(model)
    else:
        fp8_names = linears
        payload = export_weights(model, fp8_names)
    assert sorted(n for n, v in payload.items() if isinstance(v, Fp8Tensor)) == sorted(fp8_names)
    assert any(masters[n].shape[1] % 128 or masters[n].shape[0] % 128 for n in fp8_names)
    hf.write_checkpoint(
        tmp_path / "ckpt", hf.checkpoint_tensors(payload), {"architectures": ["LlamaForCausalLM"]}
    )
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for name in fp8_names:
        n, k = masters[name].shape
        weight, scale = stored[name], stored[name + "_scale_inv"]
        assert weight.dtype == F8 and tuple(weight.shape) == (n, k)
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (-(-n // 128), -(-k // 128))
        deq = weight.double() * expand(scale, (n, k))
        err = (deq - masters[name].double()).abs()
        assert bool((err <= ref.error_bound(masters[name], (128, 128), "e4m3")).all()), name
    bf16 = set(linears) - set(fp8_names)
    assert all(stored[n].dtype == torch.bfloat16 and n + "_scale_inv" not in stored for n in bf16)
