"""An RL job on the card's engines, on CPU: vLLM (its CPU build) generates, Megatron-Core (its
local layer spec over gloo) trains, weights go through vLLM's weight-transfer API with an FP8 KV
cache whose scales the trainer calibrates. Through the driver (``fp8rl run``: metrics in the log
and on Prometheus) and through the control plane (``fp8rl serve`` + POST, a real driver process).

Expected values not taken from the code: the number of weights checked at each sync is counted
by hand from the model (below), and every K/V scale must have reached vLLM's attention layers
(the contract compares them bit for bit).

vLLM's CPU attention keeps an FP8 KV cache only on x86 with AVX-512 or AMX; on a CPU without
either (plain AVX2) the same job runs with a BF16 KV cache, and that the FP8 one is refused there
with the field to change is tested in ``engines/vllm/test_config.py``.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import megatron.core  # noqa: F401  # `make engines` installs both (make test does): missing is an error
import pytest
import ray
import vllm  # noqa: F401

from rljob import parse_spec
from rljob.metrics import REQUIRED_KEYS, MetricsLog
from tests.helpers import ONE_DIGIT_SUMS, wait_for
from workers.engines.vllm.config import CpuFeatures
from workers.job.driver import RunOptions, run

# above its longest wait (pyproject's timeout of 300 s would cut that short: tests/test_timeouts.py)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]

# the example's model (vLLM's CPU FP8 KV cache needs head_dim 32): 2 layers, untied lm_head
MODEL = {"arch": "llama", "hidden_size": 128, "intermediate_size": 256, "num_layers": 2}
MODEL |= {"num_heads": 4, "num_kv_heads": 2}
# weights of that Llama, counted by hand: embed_tokens, per layer q/k/v/o, gate/up/down and two
# RMSNorms (9), the final norm and lm_head
WEIGHTS = 1 + 2 * 9 + 1 + 1
STEPS = 2
_CPU = CpuFeatures.detect()
FP8_KV_CACHE = _CPU.avx512 or _CPU.amx  # what vLLM's CPU attention can store on this machine


def engines_spec() -> dict[str, Any]:
    return {
        "model": {"tiny": MODEL},
        "task": {"params": ONE_DIGIT_SUMS, "size": 20},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3},
        "warmup": {"sft_steps": 1, "batch_size": 4},
        "precision": {"recipe": "bf16", "fp8_kv_cache": FP8_KV_CACHE},
        "resources": {"generator_engine": "vllm", "trainer_engine": "megatron"},
        "steps": STEPS,
        "checkpoint_interval": STEPS,
    }


def check_rows(rows: Sequence[Mapping[str, Any]]) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        assert not missing, missing
        assert row["sync/layers_checked"] == WEIGHTS and row["sync/layers_mismatched"] == 0
        # BF16 in both engines (E4M3 K/V in vLLM where this CPU stores it): near 1, far from a
        # broken sync (which gives exp(|log 272 - logp|) ~ 100s on the vocabulary of 272 bytes)
        assert 1.0 <= row["mismatch/token_mult_prob_error"] < 2.0
        assert row["weight_sync/bytes"] > 0 and 0.0 <= row["reward/mean"] <= 1.0


@pytest.fixture
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()


@pytest.mark.usefixtures("ray_cluster")
def test_a_job_on_vllm_and_megatron_runs_and_exports_its_metrics(tmp_path: Path) -> None:
    scraped: list[str] = []
    port: list[int] = []

    def scrape(row: Mapping[str, Any]) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port[0]}/metrics", timeout=10) as r:
            scraped.append(r.read().decode())

    def log(line: str) -> None:
        if "Prometheus" in line:
            port.append(int(line.rsplit(":", 1)[1].split("/")[0]))

    result = run(
        parse_spec(engines_spec()), tmp_path, RunOptions(metrics_port=0, job="e", on_step=scrape, log=log)
    )
    assert result.last_step == STEPS and not result.stopped
    check_rows(MetricsLog(tmp_path / "metrics.jsonl").rows())
    audit = (tmp_path / "quantization_audit.json").read_text()
    assert "vLLM" in audit  # the generator's audit is vLLM's own
    last = scraped[-1]
    assert f'fp8rl_sync_layers_checked{{job="e",namespace="default",recipe="bf16"}} {float(WEIGHTS)}' in last
    assert 'fp8rl_sync_layers_mismatched{job="e",namespace="default",recipe="bf16"} 0.0' in last
    assert "fp8rl_token_mult_prob_error{" in last


def test_a_job_on_vllm_and_megatron_through_the_control_plane(tmp_path: Path) -> None:
    from tests.service.test_lifecycle import HEADERS, getter, local_service

    with local_service(tmp_path) as api:
        posted = api.post("/v1/jobs", json={"name": "engines", "spec": engines_spec()}, headers=HEADERS)
        assert posted.status_code == 201, posted.text
        done = wait_for(
            getter(api, "engines"),
            "the engines job to finish",
            lambda j: j["status"]["phase"] in ("Succeeded", "Failed"),
            timeout=600,
        )
        logs = api.get("/v1/jobs/engines/logs", headers=HEADERS).text
        assert done["status"]["phase"] == "Succeeded", logs[-3000:]
        check_rows(api.get("/v1/jobs/engines/metrics", headers=HEADERS).json())


@pytest.mark.usefixtures("ray_cluster")
def test_vllms_engine_core_dying_is_a_generator_fault_recovered_in_place(tmp_path: Path) -> None:
    """vLLM's own death: its engine-core process killed during step 2's request, so that vLLM
    raises EngineDeadError, goes through the driver's generator recovery (fresh actors, a new vLLM,
    the trainer's weights of step 1, step 2 generated again), and the job ends with every step once."""
    from workers.rl.faults import FaultDrill

    spec = {**engines_spec(), "resources": {"generator_engine": "vllm"}, "steps": 3, "checkpoint_interval": 3}
    lines: list[str] = []
    opts = RunOptions(log=lines.append, drills=[FaultDrill.parse("generator:engine@2")])
    result = run(parse_spec(spec), tmp_path, opts)
    assert result.last_step == 3
    rows = MetricsLog(tmp_path / "metrics.jsonl").rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["faults/generator_restarts"] for r in rows] == [0.0, 1.0, 0.0]
    assert all(r["sync/layers_mismatched"] == 0 for r in rows)
    [fault] = [line for line in lines if line.startswith("fault: ")]
    assert "generator 0 failed (EngineDeadError" in fault and "step 2" in fault, fault
