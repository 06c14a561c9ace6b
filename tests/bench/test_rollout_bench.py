"""``fp8rl bench rollout``'s decode time apart from prefill (bench/rollout.py), on rows written by
hand and worked out by hand, and on a real run of the tiny model on the CPU."""

from __future__ import annotations

import math

import pytest

from bench.rollout import RolloutRow, format_table, parse_variants, run


def test_decode_time_leaves_the_prefill_out() -> None:
    # 10 new tokens: 9 decode steps. bf16: (2.0 - 0.2) / 9 = 200 ms; fp8 KV: (1.1 - 0.2) / 9 = 100 ms
    bf16 = RolloutRow("bf16", "bf16", "eager", 2.0, 640, 0, 0, 300, 10, 0.2)
    kv = RolloutRow("bf16", "fp8", "eager", 1.1, 640, 0, 0, 300, 10, 0.2)
    assert math.isclose(bf16.decode_ms, 200.0) and math.isclose(kv.decode_ms, 100.0)
    table = format_table("cpu", [bf16, kv], "tiny").splitlines()
    assert table[1].endswith("decode ms  decode vs bf16")
    assert table[2].split()[-2:] == ["200.000", "1.00x"]
    assert table[3].split()[-2:] == ["100.000", "2.00x"]  # twice as fast per decode step
    assert math.isnan(RolloutRow("bf16", "bf16", "eager", 1.0, 64, 0, 0, 300, 1, 0.5).decode_ms)


def test_a_cpu_run_times_the_prefill_apart_from_the_whole_call() -> None:
    """Both times are measured (finite, positive) and the decode time is their difference per
    decode step. Which is shorter is not asserted: they are two calls, timed apart, and on a busy
    machine the one-token call can take longer (speed is the benchmark's to report)."""
    _, rows = run("tiny", "cpu", prompts=4, new_tokens=6, repeat=1, kv_caches=("bf16",))
    assert [(r.weights, r.kv_cache) for r in rows] == [("bf16", "bf16"), ("fp8", "bf16")]
    for row in rows:
        assert row.new_tokens == 6 and 0 < row.prefill_seconds < math.inf and 0 < row.seconds < math.inf
        assert math.isclose(row.decode_ms, (row.seconds - row.prefill_seconds) / 5 * 1e3)


def test_variants_pick_weight_and_cache_pairs() -> None:
    assert parse_variants(("bf16/bf16", "fp8/fp8")) == {("bf16", False), ("fp8", True)}
    for bad in [(), ("fp8",), ("fp8/e4m3",), ("int8/bf16",)]:
        with pytest.raises(ValueError, match="give WEIGHTS/KV pairs"):
            parse_variants(bad)
    _, rows = run("tiny", "cpu", prompts=2, new_tokens=2, repeat=1, variants=("fp8/fp8", "bf16/bf16"))
    assert [(r.weights, r.kv_cache) for r in rows] == [("bf16", "bf16"), ("fp8", "fp8")]  # the plan's order
