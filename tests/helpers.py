"""What many test files share: the tiny job they run, a short run of the SmolLM2 example, and
waiting for something to happen.

``wait_for`` is the one way a test waits: it polls a public view (an API answer, a store read, a
file a run writes) until a predicate holds, and on a deadline fails saying what it waited for and
the last value it saw. A fixed ``sleep`` races on a busy machine; a private attribute ties the
test to one implementation.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

# The smallest model a job runs on: one layer, grouped-query attention (2 heads share 1 KV head)
TINY_MODEL: dict[str, int] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
}
# The engine tests' model: two layers, so that keep_bf16_layers=[1, 0] leaves one FP8 layer
TWO_LAYER_MODEL: dict[str, int] = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2}
# reasoning-gym basic_arithmetic: sums of two single-digit numbers (short prompts and answers)
ONE_DIGIT_SUMS: dict[str, int] = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def tiny_spec(**overrides: Any) -> dict[str, Any]:
    """A job spec (as JSON) that a CPU runs in seconds: :data:`TINY_MODEL` on 20 one-digit sums,
    2 prompts x 2 responses of at most 2 tokens a step, 2 steps. Each override replaces a whole
    top-level section (``tiny_spec(steps=40)``, ``tiny_spec(rollout={...})``); the result is a
    fresh copy the caller may change."""
    spec: dict[str, Any] = {
        "model": {"tiny": TINY_MODEL},
        "task": {"params": ONE_DIGIT_SUMS, "size": 20},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 2},
        "steps": 2,
    }
    return copy.deepcopy({**spec, **overrides})


def wait_for(
    get: Callable[[], T],
    what: str,
    ok: Callable[[T], object] = bool,
    timeout: float = 60.0,
    every: float = 0.2,
) -> T:
    """Call ``get`` every ``every`` seconds until ``ok`` holds for its value; return that value.
    After ``timeout`` seconds, fail with ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last value: {value!r}")
        time.sleep(every)


SMOLLM2_EXAMPLE = Path(__file__).parents[1] / "examples" / "smollm2-addition.yaml"


def run_smollm2_example(
    model_dir: Path, out: Path, recipe: str, timeout: int, **sets: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``fp8rl run`` of the SmolLM2 example as a user runs it (the console script of this
    environment), two steps with a smaller batch and validation set (2 prompts x 4 samples, 8
    held-out problems every 2 steps), plus ``sets`` (``--set`` overrides, dots as ``__``).
    Asserts exit 0, steps 1 and 2 and the validations at 0 and 2; returns (every metrics line,
    the step lines)."""
    overrides = {
        "model.name": str(model_dir),
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 4,
        "validation.size": 8,
        "validation.interval": 2,
    } | {k.replace("__", "."): v for k, v in sets.items()}
    args = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    cli = [str(Path(sys.executable).parent / "fp8rl")]
    proc = subprocess.run(
        [*cli, "run", str(SMOLLM2_EXAMPLE), "--recipe", recipe, "--steps", "2", "--output", str(out),
         "--no-progress", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in rows if "val/accuracy" in r] == [0, 2]
    return rows, steps
