"""Shared test fixtures (fresh random inputs each run, with the seed printed for reproduction; the
real model and its 2-layer copy) and the suite's tiers (docs/development.md#tests):

- ``slow``: end-to-end runs (drivers, Ray, servers); ``model``: the real pretrained weights;
  ``engines``: vLLM or Megatron-Core; ``kube``: the real Kubernetes of tests/kube; ``gpu``: CUDA.
- ``model``, ``engines`` and ``kube`` are given here, from the fixtures a test uses and where it
  lies; ``slow`` and ``gpu`` are written on the test.
- A test whose call takes over ``FP8RL_TIER_LIMIT_S`` (10 s) with none of these fails, naming
  its time: mark it, or make it faster.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# the real Kubernetes of the suite (tests/kube/README.md): kube, chart, operator, podnet, tenant, ...
pytest_plugins = ["tests.kube.fixtures"]

# The suite quantizes eagerly (drivers and Ray actors it starts inherit this): the compiled CPU
# quantizer of power-of-two scales (workers/fp8/cpu_compiled.py) costs a build of 5-20 s per
# process, and tests/workers/fp8/test_cpu_compiled.py holds it to the eager one bit for bit.
os.environ.setdefault("FP8RL_CPU_COMPILE", "0")

TIERS = ("slow", "model", "engines", "kube", "gpu")
TIER_LIMIT_S = float(os.environ.get("FP8RL_TIER_LIMIT_S", "10"))
TESTS = Path(__file__).resolve().parent
ENGINE_DIRS = (TESTS / "workers" / "engines" / "vllm", TESTS / "workers" / "engines" / "megatron")
MODEL_FIXTURES = {"smollm2_dir"}  # a test of the 2-layer copy (smollm2_small_dir) loads no real weights
KUBE_FIXTURES = {"kube", "podnet"}  # the others (chart, operator, tenant) need kube


def tiers_of(path: Path, fixtures: set[str]) -> list[str]:
    """The tiers a test gets from where it lies and the fixtures it uses."""
    tiers = []
    if fixtures & MODEL_FIXTURES and "smollm2_small_dir" not in fixtures:
        tiers.append("model")
    if any(path.is_relative_to(d) for d in ENGINE_DIRS):
        tiers.append("engines")
    if fixtures & KUBE_FIXTURES or path.is_relative_to(TESTS / "kube"):
        tiers.append("kube")
    return tiers


def pytest_configure(config: pytest.Config) -> None:
    """On a pytest-xdist worker, torch gets its share of the cores (2 cores, 2 workers: one thread
    each), and so do the drivers and servers it starts (``OMP_NUM_THREADS``, unless set). Two
    workers of torch's default (a thread per core each) oversubscribe the cores, and OpenMP
    threads that wait on busy cores make each other crawl: measured on 2 cores, a SmolLM2
    validation test beside the FP8 kernel tests took 82 s and they 58 s; with one thread each,
    62 s and 20 s. The job's Ray actors share the cores out themselves (``resources.threads``)."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        for tier in tiers_of(Path(str(item.path)), set(getattr(item, "fixturenames", ()))):
            item.add_marker(tier)
            if tier == "kube":  # one cluster per run: `pytest -n 2 --dist loadgroup` keeps them on one worker
                item.add_marker(pytest.mark.xdist_group("kube"))
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip)


def over_the_limit(seconds: float, markers: set[str], limit: float = TIER_LIMIT_S) -> str | None:
    """Why a test's call of ``seconds`` breaks the tier rule, or None."""
    if seconds <= limit or markers & set(TIERS):
        return None
    return (
        f"the test took {seconds:.1f} s (over {limit:g} s) and has no tier marker ({', '.join(TIERS)}): "
        "mark it `slow` (docs/development.md#tests), or make it faster"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.passed:
        return
    why = over_the_limit(call.duration, {m.name for m in item.iter_markers()})
    if why:
        report.outcome = "failed"
        report.longrepr = why


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> Iterator[int]:
    """A fresh seed per test (or FP8RL_TEST_SEED), printed so a failure can be replayed."""
    value = int(os.environ.get("FP8RL_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(value)
    random.seed(value)
    print(f"\n[seed] FP8RL_TEST_SEED={value} reproduces {request.node.nodeid}")
    yield value


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, fetched once per machine into the real
    cache ($FP8RL_HOME, else ~/.cache/fp8rl; docs/models.md) and reused by every test and run.
    A fetch that fails fails the tests with its message (no skip: offline machines must know)."""
    from workers.models.store import ModelStoreError, fetch

    try:
        return fetch("smollm2-135m-instruct")
    except ModelStoreError as err:
        pytest.fail(f"fetching smollm2-135m-instruct: {err}", pytrace=False)


SMALL_LAYERS = 2


@pytest.fixture(scope="session")
def smollm2_small_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer, chat template, generation config and
    vocabulary: the real model's path (HF tokenizer, chat prompts, stop ids, the example's task)
    in seconds, for tests of the plumbing rather than of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smollm2-small") / "smollm2-small"
    out.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, out / f.name)
    config = AutoConfig.from_pretrained(smollm2_dir)
    config.update({"num_hidden_layers": SMALL_LAYERS, "hidden_size": 64, "intermediate_size": 128,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out
