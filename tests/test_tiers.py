"""The suite's tiers (tests/conftest.py): each test gets the tiers of what it uses, and a test over
the time limit without one fails. Checked on hand-made cases, and on a real pytest run of a
made-up module whose tests sleep past a lowered limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TESTS, over_the_limit, tiers_of

ROOT = TESTS.parent


def test_tiers_come_from_fixtures_and_folders() -> None:
    assert tiers_of(TESTS / "workers" / "test_smollm2.py", {"smollm2_dir", "tmp_path"}) == ["model"]
    assert tiers_of(TESTS / "bench" / "x.py", {"smollm2_dir", "smollm2_small_dir"}) == []
    assert tiers_of(TESTS / "workers" / "engines" / "vllm" / "test_x.py", set()) == ["engines"]
    assert tiers_of(TESTS / "workers" / "engines" / "native" / "test_x.py", set()) == []
    assert tiers_of(TESTS / "service" / "test_kube_store.py", {"tenant", "kube"}) == ["kube"]
    assert tiers_of(TESTS / "kube" / "test_rbac.py", set()) == ["kube"]


def test_the_limit_applies_to_untiered_tests_only() -> None:
    assert over_the_limit(9.9, set(), limit=10) is None
    assert over_the_limit(30.0, {"slow"}, limit=10) is None
    assert over_the_limit(30.0, {"parametrize", "kube"}, limit=10) is None
    why = over_the_limit(12.34, {"parametrize", "timeout"}, limit=10)
    assert why is not None and "12.3 s" in why and "slow" in why


@pytest.mark.slow  # a pytest of its own that imports torch: ~7 s on 2 idle cores, 12 s on busy ones
def test_a_real_run_fails_the_untiered_sleeper_only(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(
        "import time\nimport pytest\n\n"
        "def test_untiered():\n    time.sleep(0.6)\n\n"
        "@pytest.mark.slow\ndef test_marked():\n    time.sleep(0.6)\n\n"
        "def test_quick():\n    pass\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), "-c", str(ROOT / "pyproject.toml"), str(tmp_path / "test_probe.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "FP8RL_TIER_LIMIT_S": "0.3"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "FAILED" in out and "test_untiered" in out and "no tier marker" in out, out


@pytest.mark.slow  # two workers that each import torch: ~14 s
def test_the_tests_on_the_cluster_share_one_worker(tmp_path: Path) -> None:
    """`make test` runs two workers; the tests on the test cluster (here, those that take a
    `kube` fixture, a local stand-in for the session's cluster) must all run on one of them, or
    each worker would start a cluster of its own. (pytest 9.2 broke pytest-xdist's groups,
    pytest-xdist#1386: this test fails there.)"""
    log = tmp_path / "workers.log"
    (tmp_path / "test_probe.py").write_text(
        "import os, time\nimport pytest\n\n"
        "@pytest.fixture\ndef kube():\n    return None\n\n"
        f"def record(what):\n    time.sleep(0.2)\n    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(what + ' ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_on_cluster(kube, i):\n    record('kube')\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_elsewhere(i):\n    record('other')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "-n", "2", "--dist", "loadgroup",
         "--rootdir", str(tmp_path), "-c", str(ROOT / "pyproject.toml"), str(tmp_path / "test_probe.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "12 passed" in out, out
    seen = [line.split() for line in log.read_text().splitlines()]
    assert len([w for what, w in seen if what == "kube"]) == 6
    assert len({w for what, w in seen if what == "kube"}) == 1, seen
    assert len({w for _, w in seen}) == 2, seen  # and the other worker did work too
