"""Local drivers get a minimal environment (``service.driver_process.driver_environment``): what
the driver and its runtimes read, never the service's secrets."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from rljob.run_dir import RunDir
from rljob.spec import parse_spec
from service.driver_process import DRIVER_ENV_NAMES, driver_environment
from service.local_executor import LocalExecutor
from service.settings import Settings
from service.store import SqlJobStore
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
# a stand-in driver: writes its environment where the metrics would go, then exits 0
_DUMP = """
import json, os, sys
open(sys.argv[1] + ".tmp", "w").write(json.dumps(dict(os.environ)))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
"""

# what the service's host may hold, none of which a tenant's driver may see
SECRETS = {
    "FP8RL_TOKENS_FILE": "/etc/fp8rl/tokens/tokens.yaml",
    "FP8RL_KUBECONFIG": "/etc/kube/config",
    "FP8RL_TENANT_LIMITS": '{"team-a": {"max_gpus": 1}}',
    "KUBECONFIG": "/root/.kube/config",
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "DATABASE_URL": "postgres://u:p@db/fp8rl",
    "SECRET_X": "the-secret",
    "HF_TOKEN": "hf_secret",
    "RAY_AUTH_TOKEN": "ray-secret",
    "WANDB_API_KEY": "wandb-secret",
    "HTTPS_PROXY": "http://user:password@proxy:3128",
}
# what a driver needs, where the service has it
NEEDED = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/var/lib/fp8rl",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONPATH": "/opt/extra",
    "FP8RL_HOME": "/models",
    "FP8RL_TRITON": "0",
    "RAY_DEDUP_LOGS": "0",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "HF_HOME": "/models/hf",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "2",
    "NCCL_DEBUG": "WARN",
}


def test_a_driver_sees_what_it_needs_and_none_of_the_services_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**SECRETS, **NEEDED}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:/opt/extra")  # the stand-in imports nothing of ours

    def command(run: RunDir, job: Any, resume: bool) -> list[str]:
        return [sys.executable, "-c", _DUMP, str(run.root / "env.json")]

    monkeypatch.setattr("service.local_executor.driver_command", command)
    store = SqlJobStore(tmp_path / "jobs.sqlite")
    job = store.create("team-a", "env", parse_spec({"steps": 1}))
    executor = LocalExecutor(store, tmp_path, poll_s=0.1, driver_env=["SECRET_X"])  # one named extra
    executor.submit(job)
    try:
        dump = tmp_path / "runs" / "team-a" / "env" / "env.json"
        wait_for(dump.exists, "the stand-in driver to write its environment", timeout=60)
        seen: dict[str, str] = json.loads(dump.read_text())
    finally:
        executor.cancel(job)
    own = {"PYTHONPATH", "HOME", "HF_HOME"}  # the path set below; the tenant's own caches
    assert {k: seen.get(k) for k in NEEDED if k not in own} == {
        k: v for k, v in NEEDED.items() if k not in own
    }
    # HOME and the Hugging Face cache are the tenant's, not the service's (its stored token is there)
    cache = tmp_path / "cache" / "team-a"
    assert seen["HOME"] == str(cache) and seen["HF_HOME"] == str(cache / "huggingface")
    assert seen["PYTHONPATH"] == f"{ROOT}:/opt/extra"
    leaked = sorted(set(SECRETS) & set(seen) - {"SECRET_X"})
    assert leaked == []
    assert seen["SECRET_X"] == "the-secret"  # driver_env passes what a site names, as it is
    values = set(seen.values())
    assert not any(v in values for k, v in SECRETS.items() if k != "SECRET_X")


def test_the_allow_list_passes_families_but_not_secret_looking_names() -> None:
    env = {
        "LC_TIME": "C",
        "TORCHINDUCTOR_CACHE_DIR": "/c",
        "VLLM_LOGGING_LEVEL": "ERROR",
        "RAY_ADDRESS": "auto",
        "RAY_AUTH_MODE": "token",
        "NCCL_SOCKET_IFNAME": "eth0",
        "HF_TOKEN": "x",
        "HUGGING_FACE_HUB_TOKEN": "x",
        "VLLM_API_KEY": "x",
        "CUDA_PASSWORD": "x",
        # issue 49: names the filter missed
        "RAY_APIKEY": "x",
        "TORCH_PWD": "x",
        "RAY_DSN": "x",
        "RAY_REDIS_PASSWORDFILE": "x",
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "FP8RL_STORE": "sql",
        "FP8RL_DRIVER_ENV": "HF_TOKEN",
    }
    assert sorted(driver_environment(env)) == [
        "LC_TIME",
        "NCCL_SOCKET_IFNAME",
        "TORCHINDUCTOR_CACHE_DIR",  # not RAY_ADDRESS: a local driver starts its own Ray
        "VLLM_LOGGING_LEVEL",
    ]
    assert driver_environment(env, ["HF_TOKEN", "NOT_SET"]) == {**driver_environment(env), "HF_TOKEN": "x"}
    assert Settings(driver_env=" HF_TOKEN, HTTPS_PROXY ,").driver_env_names == ["HF_TOKEN", "HTTPS_PROXY"]


def test_every_fp8rl_variable_the_driver_reads_is_passed() -> None:
    """A switch added to workers/ (``FP8RL_*``) must reach the driver: this fails until it is in
    ``DRIVER_ENV_NAMES``."""
    read = set()
    for source in (ROOT / "workers").rglob("*.py"):
        read |= set(re.findall(r"\bFP8RL_[A-Z0-9_]*[A-Z0-9]\b", source.read_text()))
    assert read, "found no FP8RL_* variable in workers/: the scan is broken"
    assert read - DRIVER_ENV_NAMES == set()
