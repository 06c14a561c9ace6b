"""Megatron-Core 0.16.1 (local layer spec, gloo, CPU) on a real pretrained model, SmolLM2-135M-Instruct:
30 layers, grouped-query attention with 9 query heads over 3 KV heads (``linear_qkv`` interleaved
per query group), tied embeddings (no ``output_layer`` weight of its own), vocabulary 49,152.

The reference is transformers' ``LlamaForCausalLM`` on the same directory and tokens, in float32
and in float64. Both engines compute in float32 (the Megatron trainer's ``compute_dtype``), so
they may differ by float32 rounding in another order of operations only (fused q/k/v GEMM,
baddbmm attention scores, torch's RMSNorm). Measured on this machine, on chat prompts with their
answers (logits up to ~38):

- Megatron vs transformers float32, eager attention: 0 (bit-identical); vs SDPA attention 7.4e-5;
- either float32 model vs float64: 6.6e-5, the size of float32's accumulation-order rounding over
  30 layers here.

Bound: 5e-4 absolute (~7x the float32-vs-float64 distance, 1.3e-5 of the largest logit). A
mapping error is orders of magnitude above it: a q/k/v head in the wrong group, a dropped tied
output layer (logits of zero rows), or a swapped norm move logits by O(1).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import megatron.core as megatron_core  # noqa: F401  # `make engines` installs it (make test does): missing is an error
import pytest
import torch

from rljob.spec import JobSpec, load_spec
from tests.workers.engines.megatron.megatron_cpu import megatron_logits, one_rank_group
from workers.engines.megatron.trainer import MegatronTrainer
from workers.models.tokenizer import build_tokenizer
from workers.tasks import Task

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parents[4] / "examples" / "smollm2-addition.yaml"
VOCAB = 49152  # SmolLM2's, already a multiple of 128: no padded rows
ATOL = 5e-4


@pytest.fixture
def group() -> Iterator[None]:
    yield from one_rank_group()


def test_megatron_logits_of_smollm2_equal_transformers(group: Any, smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    data = load_spec(EXAMPLE).model_dump()
    data["model"]["name"] = str(smollm2_dir)
    data["precision"]["recipe"] = "bf16"
    data["resources"].update({"trainer_engine": "megatron", "gpus_per_trainer": 0})
    spec = JobSpec.model_validate(data)
    tok = build_tokenizer(spec)
    task = Task.for_job(spec, tok)
    # chat prompts with their answers and the end of the turn, right-padded: causal attention
    # keeps the pads from every real position, so both models see each row as if alone
    rows = [tok.encode(f"{task.prompt(p)}{p.answer}<|im_end|>") for p in task.validation_problems()[:4]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])  # [4, T]
    real = torch.tensor([[t < len(r) for t in range(width)] for r in rows])  # [4, T]
    assert len({len(r) for r in rows}) > 1  # rows of several lengths

    meg = MegatronTrainer(spec, tok.vocab_size, "cpu", compute_dtype=torch.float32)
    shapes = meg.model.shapes
    assert (shapes.heads, shapes.kv_heads, shapes.tied, shapes.padded_vocab) == (9, 3, True, VOCAB)
    got = megatron_logits(meg, ids)[real]  # [N, V]
    del meg

    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        expected = hf.eval()(input_ids=ids).logits[real]  # [N, V]
        exact = hf.double()(input_ids=ids).logits[real]  # [N, V] float64
    worst, size = float((got - expected).abs().max()), float(expected.abs().max())
    rounding = float((expected.double() - exact).abs().max())
    print(
        f"SmolLM2: max |logit diff| Megatron vs transformers {worst:.2e}, Megatron vs float64 "
        f"{float((got.double() - exact).abs().max()):.2e}, transformers float32 vs float64 {rounding:.2e}, "
        f"max |logit| {size:.1f}, {got.shape[0]} positions"
    )
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.double(), exact, atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
