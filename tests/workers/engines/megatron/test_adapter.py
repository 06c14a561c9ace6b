"""The Megatron trainer adapter's module imports without Megatron-Core. test_megatron_cpu.py runs
the adapter on the real Megatron-Core (a GRPO step and an SFT step equal to the native trainer's,
the same K/V scales); a stand-in for Megatron-Core that repeated those tests is gone."""

from __future__ import annotations

import subprocess
import sys


def test_the_trainer_module_imports_without_megatron() -> None:
    """In a fresh interpreter: other tests of this session may have imported Megatron already."""
    code = (
        "import sys, workers.engines.megatron.trainer; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'transformer_engine'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
