"""The three-launch sampling (workers/engines/native/triton_sample.py): the draw, log-probs,
padding, ties, non-finite rows and the generator taking it, under Triton's interpreter (in a fresh
interpreter: ``sample_checks.py``); its switch and input checks; its compilation for SM90. Its
speed only a GPU shows (``fp8rl bench sampling``)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.interpreter import run_under_interpreter
from tests.workers.switches import assert_off_by_default_and_checked
from tests.workers.triton_sm90 import compile_sm90
from workers.engines.native import sampling, triton_sample

pytestmark = pytest.mark.timeout(660)  # above the subprocess's wait (tests/test_timeouts.py)


@pytest.mark.slow  # each program of ~150 small launches and two decodes, interpreted: ~55 s (2026-12-02)
def test_the_sampling_kernels_under_the_interpreter() -> None:
    out = run_under_interpreter("tests.workers.engines.native.sample_checks", timeout=600)
    assert out.count("ok ") == 5


def test_the_switch_is_off_by_default_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_off_by_default_and_checked(monkeypatch, "FP8RL_SAMPLING", sampling.enabled)


def test_bad_inputs_are_refused_before_any_launch() -> None:
    logits = torch.zeros(3, 100)
    done = torch.zeros(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="pad id 100 is outside the vocabulary of 100"):
        triton_sample.sample_rows(logits, 1.0, None, done, 100)
    with pytest.raises(ValueError, match=r"finished must be bool \[3\]"):
        triton_sample.sample_rows(logits, 1.0, None, done[:2], 0)
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_sample.sample_rows(logits.t(), 1.0, None, done, 0)


def test_ranges_give_two_programs_per_processor_and_at_least_a_block_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worked by hand for 132 processors: ceil(264 / B) ranges, at most ceil(V / 1024)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_sample, "multiprocessors", lambda device, elsewhere: 132)
    assert triton_sample.default_splits(1, 128256, cuda) == 126  # ceil(128256 / 1024)
    assert triton_sample.default_splits(8, 128256, cuda) == 33
    assert triton_sample.default_splits(256, 128256, cuda) == 2
    assert triton_sample.default_splits(1024, 49152, cuda) == 1
    assert triton_sample.default_splits(4, 1000, cuda) == 1  # one block


SIG = {"logits_ptr": "*bf16", "stride_l": "i32", "temperature": "fp32"}


@pytest.mark.parametrize("greedy", [False, True])
def test_the_kernels_compile_for_sm90_with_ieee_division_and_no_spills(greedy: bool) -> None:
    ranges = {"stats_ptr": "*fp32", "vocab": "i32", "span": "i32", "splits": "i32"}
    stats = compile_sm90(triton_sample._range_stats, SIG | ranges, {"BLOCK": 1024, "HW": True}, num_warps=4)
    pick_sig = SIG | ranges | {"noise_ptr": "*fp32", "lse_ptr": "*fp32", "best_ptr": "*fp32"}
    pick_sig |= {"index_ptr": "*i32", "stride_n": "i32"}
    consts = {"BLOCK": 1024, "BLOCK_S": 4, "GREEDY": greedy, "HW": True}
    pick = compile_sm90(triton_sample._range_pick, pick_sig, consts, num_warps=4)
    finish_sig = SIG | {"lse_ptr": "*fp32", "best_ptr": "*fp32", "index_ptr": "*i32", "finished_ptr": "*i1"}
    finish_sig |= {"tok_ptr": "*i64", "logp_ptr": "*fp32", "splits": "i32", "pad_id": "i32"}
    finish = compile_sm90(triton_sample._finish, finish_sig, {"BLOCK_S": 4}, num_warps=1)
    for ptx in (stats, pick, finish):
        assert "div.rn.f32" in ptx  # the temperature's (and the race's) IEEE division
        assert "div.full.f32" not in ptx and "div.approx.f32" not in ptx
        assert "st.local" not in ptx
    # libdevice's expf (an fma range reduction around ex2.approx, Triton linking it with subnormals
    # flushed), not tl.exp's scaled ex2.approx: the stats' exp (and the race's, checked alike)
    fast = compile_sm90(triton_sample._range_stats, SIG | ranges, {"BLOCK": 1024, "HW": False}, num_warps=4)
    assert stats.count("fma.") > fast.count("fma.") and "ex2.approx.ftz.f32" in stats
    if not greedy:
        fast = compile_sm90(triton_sample._range_pick, pick_sig, consts | {"HW": False}, num_warps=4)
        assert pick.count("fma.") > fast.count("fma.") + 9 and "ex2.approx.ftz.f32" in pick
