"""The one-launch checksums of a weight report (workers/weight_sync/triton_checksum.py): the
integers of the torch checksum under Triton's interpreter (in a fresh interpreter:
``checksum_checks.py``), its switch, and its compilation for SM90. Its speed only a GPU shows;
its launches: test_sync_launches.py."""

from __future__ import annotations

import pytest

from tests.workers.interpreter import run_under_interpreter
from tests.workers.switches import assert_off_by_default_and_checked
from tests.workers.triton_sm90 import compile_sm90
from workers.weight_sync.contract import batched_checksums

pytestmark = pytest.mark.timeout(360)  # above the subprocess's wait (tests/test_timeouts.py)


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers): ~10 s
def test_the_checksum_kernel_under_the_interpreter() -> None:
    out = run_under_interpreter("tests.workers.weight_sync.checksum_checks", timeout=300)
    assert out.count("ok ") == 2


def test_the_switch_is_off_by_default_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_off_by_default_and_checked(monkeypatch, "FP8RL_CHECKSUM", batched_checksums)


def test_the_checksum_kernel_compiles_for_sm90_without_spills() -> None:
    from workers.weight_sync import triton_checksum as k

    sig = {"table_ptr": "*i64", "owner_ptr": "*i64", "partial_ptr": "*i64"}
    consts = {"MODULUS": k.MODULUS, "FIELDS": k.FIELDS, "CHUNK": k.CHUNK, "BLOCK": k.BLOCK}
    ptx = compile_sm90(k._checksum_many, sig, consts)
    assert "st.local" not in ptx and "atom." not in ptx  # no spills; partial sums, no atomics
    assert "ld.global" in ptx and "st.global" in ptx
