"""The run contract (``rljob.run_dir``) read from outside: the file names a run directory holds,
the driver's command line in its two forms, and the service and the operator starting the driver
with the same command for the same job."""

from __future__ import annotations

import re
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

from operators import builders
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.jobs import Job
from rljob.run_dir import RunDir, driver_argv
from rljob.spec import JobSpec
from rljob.status import JobStatus
from service.local_runs import driver_command, run_dir
from workers.job import driver

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("fp8rl", "rljob", "workers", "service", "operators", "bench")


def test_a_run_directory_names_its_files() -> None:
    run = RunDir(Path("/runs/j"))
    files = [run.spec_resolved, run.metrics, run.quantization_audit, run.warmup, run.checkpoints,
             run.job_spec, run.driver_log, run.driver_pid, run.numerics]  # fmt: skip
    # the names users and tools see, written out here rather than read from the code
    assert [str(f) for f in files] == [
        "/runs/j/spec.resolved.json",
        "/runs/j/metrics.jsonl",
        "/runs/j/quantization_audit.json",
        "/runs/j/warmup.jsonl",
        "/runs/j/checkpoints",
        "/runs/j/job.json",
        "/runs/j/driver.log",
        "/runs/j/driver.pid",
        "/runs/j/numerics.json",
    ]
    assert run_dir(Path("/data"), "team-a", "j") == RunDir(Path("/data/runs/team-a/j"))


def test_the_driver_command_line_in_both_forms() -> None:
    local = driver_argv("d/job.json", "d", job="j", namespace="team-a", resume=False, metrics_port=None)
    assert local == ["python", "-m", "workers.job.driver", "d/job.json", "--output", "d", "--job", "j",
                     "--namespace", "team-a"]  # fmt: skip
    pod = driver_argv(
        "/etc/fp8rl/job.json", "/runs/j", job="j", namespace="team-a", resume=True, metrics_port=9400
    )
    assert pod == ["python", "-m", "workers.job.driver", "/etc/fp8rl/job.json", "--output", "/runs/j",
                   "--resume", "--metrics-port", "9400", "--job", "j", "--namespace", "team-a"]  # fmt: skip


def test_the_service_and_the_operator_start_the_driver_with_one_command(tmp_path: Path) -> None:
    """Built from the same job (``j`` of tenant/namespace ``team-a``, resuming), the two commands
    are equal but for what is documented to differ: the interpreter, where the spec file and the
    run directory are, the operator's Prometheus port (local drivers serve none: the service
    reads metrics.jsonl) and its in-place retries on the Ray cluster (the service starts a failed
    local driver again itself: driver_retries). Both parse with the driver's own parser."""
    spec = JobSpec(steps=3, output_dir="/runs/j")
    now = datetime.now(UTC)
    job = Job("team-a", "j", spec, JobStatus(), now, now)
    run = run_dir(tmp_path, "team-a", "j")
    local = driver_command(run, job, resume=True)
    obj = rl.manifest("j", "team-a", spec)
    obj["metadata"]["uid"] = "u-1"
    settings = OperatorSettings()
    pod = shlex.split(builders.rayjob(rl.RLJob.of(obj), settings)["spec"]["entrypoint"])

    assert local[0] == sys.executable and pod[0] == "python"
    seen_local, seen_pod = driver.parser().parse_args(local[3:]), driver.parser().parse_args(pod[3:])
    assert (seen_local.spec, seen_local.output) == (str(tmp_path / "runs/team-a/j/job.json"), str(run.root))
    assert (seen_pod.spec, seen_pod.output) == ("/etc/fp8rl/job.json", "/runs/j")
    assert (seen_local.metrics_port, seen_pod.metrics_port) == (None, settings.metrics_port)
    assert (seen_local.in_place_retries, seen_pod.in_place_retries) == (0, settings.in_place_retries)
    for seen in (seen_local, seen_pod):
        assert (seen.job, seen.namespace, seen.resume) == ("j", "team-a", True)

    def normalized(argv: list[str], spec_file: str, output: str) -> list[str]:
        out = ["PYTHON", *argv[1:]]
        for flag in ("--metrics-port", "--in-place-retries"):
            if flag in out:
                i = out.index(flag)
                del out[i : i + 2]
        return [{spec_file: "SPEC", output: "OUT"}.get(a, a) for a in out]

    assert normalized(local, seen_local.spec, seen_local.output) == normalized(
        pod, seen_pod.spec, seen_pod.output
    )


def test_the_driver_module_is_named_in_one_production_module() -> None:
    """The driver's module is the one coupling between tiers that imports do not show: it is
    spelled once (``rljob.run_dir.DRIVER_MODULE``)."""
    naming = sorted(
        str(p.relative_to(ROOT))
        for package in PRODUCTION
        for p in (ROOT / package).rglob("*.py")
        if re.search(r"workers\.job\.driver\b", p.read_text())
    )
    assert naming == ["rljob/run_dir.py"]
