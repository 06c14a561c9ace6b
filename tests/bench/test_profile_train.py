"""``fp8rl bench profile-train`` (bench/profile_train.py): the difference list worked by hand, and
a real profile of the tiny preset on the CPU (the GPU session runs it on CUDA kernels)."""

from __future__ import annotations

import pytest

from bench import profile_train as pt


def _profile(recipe: str, **ms: float) -> pt.Profile:
    return pt.Profile(recipe, 100.0, pt.kernels_of([(name, 1, t * 1000.0) for name, t in ms.items()]))


def test_kernels_merge_by_name_largest_first() -> None:
    rows = pt.kernels_of([("gemm", 2, 3000.0), ("cast", 5, 500.0), ("gemm", 1, 1500.0)])
    assert rows == (pt.Kernel("gemm", 3, 4.5), pt.Kernel("cast", 5, 0.5))


def test_the_difference_is_named_largest_change_first_until_covered() -> None:
    base = _profile("bf16", a=10.0, b=5.0)
    fp8 = _profile("fp8-e2e", a=10.0, b=8.0, c=4.0)  # +7 ms: c +4, b +3, a 0 (by hand)
    rows, named = pt.difference(base, fp8, cover=0.5)
    assert rows == [("c", 0.0, 4.0)] and named == pytest.approx(4 / 7)
    rows, named = pt.difference(base, fp8, cover=0.9)
    assert [r[0] for r in rows] == ["c", "b"] and named == pytest.approx(1.0)
    # a kernel that got faster counts against the total it names
    faster = _profile("fp8-e2e", a=6.0, b=5.0, c=5.0)  # +1 ms: c +5, a -4
    rows, named = pt.difference(base, faster, cover=1.0)
    assert [r[0] for r in rows] == ["c", "a"] and named == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"--cover 1\.5"):
        pt.difference(base, fp8, cover=1.5)


def test_bad_sizes_are_refused_by_option() -> None:
    with pytest.raises(ValueError, match="--sequences 0"):
        pt.synthetic_batch(0, 4, 4, 256)
    with pytest.raises(ValueError, match="--group-size 3"):
        pt.run("tiny", "cpu", sequences=8, group_size=3)
    with pytest.raises(ValueError, match="--top 0"):
        pt.report("tiny", "cpu", top=0)
    with pytest.raises(ValueError, match="--recipes"):
        pt.report("tiny", "cpu", recipes=())


@pytest.mark.slow
def test_a_cpu_profile_finds_the_fp8_linears_only_in_fp8_e2e() -> None:
    text = pt.report(
        "tiny",
        "cpu",
        ("bf16", "fp8-e2e"),
        top=5,
        sequences=8,
        prompt_tokens=4,
        new_tokens=4,
        group_size=4,
        micro_batch=4,
    )
    bf16, fp8 = text.split("\nfp8-e2e: ")[0], text.split("\nfp8-e2e - bf16: ")[1]
    assert "_Fp8LinearFn" not in bf16  # BF16 training never enters the FP8 linear
    assert "_Fp8LinearFn" in fp8  # and its forward and backward are fp8-e2e's extra time
    assert "fp8-e2e: " in text and " ms in kernels; the " in text
