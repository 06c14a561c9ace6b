"""The run contract: what a run directory holds, and the one command line that starts a driver.

A run directory is a job's ``output_dir`` (``fp8rl run --output``; ``<data-dir>/runs/<tenant>/<name>``
for a job the service runs locally; the job's ``output_dir`` in its RayJob's pods). Its files, who
writes them and who reads them:

- ``spec.resolved.json``: the spec the driver runs, written at its start; ``fp8rl report`` and
  ``fp8rl export`` read it.
- ``metrics.jsonl``: one line per step, by the driver; the service's monitor and
  ``/v1/jobs/{name}/metrics``, ``fp8rl report`` and the benchmarks read it.
- ``quantization_audit.json``: which layers are FP8 (and why not), by the driver once its actors
  are up.
- ``numerics.json``: what the run's numbers depend on beyond its spec, by the driver at its start:
  torch and CUDA versions, how the driver's node runs a BF16 GEMM on its CPU, and the ``FP8RL_*``
  kernel switches as set (``workers.job.numerics``); two runs' mismatch can be told apart afterwards.
- ``warmup.jsonl``: one line per SFT warm-up step (``warmup.sft_steps``).
- ``faults.jsonl``: one line per data-plane fault the driver recovered from (which actor, which
  step, what was done, seconds); the service's monitor reads it into the job's conditions.
- ``checkpoints/step_N/``: by the driver (``workers.models.checkpoint``); ``--resume`` and
  ``fp8rl export`` read them.
- ``job.json``: the spec as submitted, which the driver is started with: written by the service's
  local executor; on Kubernetes it is the key of the job's ConfigMap, mounted in the head pod.
- ``driver.log``: the driver's output, by the local executor; ``/v1/jobs/{name}/logs`` serves it.
- ``driver.pid``: the local driver's pid and start time, so a restarted service re-attaches it.

``driver_argv`` is the driver's command line, for both places that start one: the service's local
executor (a process per job) and the operator (a RayJob's entrypoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePath

SPEC_RESOLVED = "spec.resolved.json"
METRICS = "metrics.jsonl"
QUANTIZATION_AUDIT = "quantization_audit.json"
NUMERICS = "numerics.json"
WARMUP = "warmup.jsonl"
FAULTS = "faults.jsonl"
MISMATCH_LAYERS = "mismatch_layers.jsonl"
PRECISION_ACTIONS = "precision_actions.jsonl"
CHECKPOINTS = "checkpoints"
JOB_SPEC = "job.json"
DRIVER_LOG = "driver.log"
DRIVER_PID = "driver.pid"

# the driver's module: the entrypoint both the local executor and the operator start
DRIVER_MODULE = "workers.job.driver"


@dataclass(frozen=True)
class RunDir:
    """A run directory: the path of each file a run writes (see the module docstring)."""

    root: Path

    @property
    def spec_resolved(self) -> Path:
        return self.root / SPEC_RESOLVED

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def faults(self) -> Path:
        return self.root / FAULTS

    @property
    def mismatch_layers(self) -> Path:
        return self.root / MISMATCH_LAYERS

    @property
    def precision_actions(self) -> Path:
        return self.root / PRECISION_ACTIONS

    @property
    def quantization_audit(self) -> Path:
        return self.root / QUANTIZATION_AUDIT

    @property
    def numerics(self) -> Path:
        return self.root / NUMERICS

    @property
    def warmup(self) -> Path:
        return self.root / WARMUP

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def job_spec(self) -> Path:
        return self.root / JOB_SPEC

    @property
    def driver_log(self) -> Path:
        return self.root / DRIVER_LOG

    @property
    def driver_pid(self) -> Path:
        return self.root / DRIVER_PID


def driver_argv(
    spec_file: str | PurePath,
    output: str | PurePath,
    *,
    job: str,
    namespace: str,
    resume: bool,
    metrics_port: int | None,
    metrics_linger: int = 0,
    in_place_retries: int = 0,
    python: str = "python",
) -> list[str]:
    """The driver's command line: ``python -m <driver> SPEC --output DIR [--resume]
    [--metrics-port PORT [--metrics-linger S]] --job NAME --namespace NS``.

    ``resume``: continue from the newest checkpoint in ``output``; ``metrics_port``: serve
    Prometheus ``/metrics`` there (None: no HTTP server), and ``metrics_linger`` seconds more after
    the run ends (0: none); ``job`` and ``namespace`` label the metrics; ``in_place_retries``:
    start a failed driver again on its Ray cluster (``workers.job.supervisor``, 0: never).
    ``python``: the interpreter (the image's ``python``, or the service's own).
    """
    argv = [python, "-m", DRIVER_MODULE, str(spec_file), "--output", str(output)]
    if resume:
        argv.append("--resume")
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
        if metrics_linger:
            argv += ["--metrics-linger", str(metrics_linger)]
    argv += ["--job", job, "--namespace", namespace]
    if in_place_retries:
        argv += ["--in-place-retries", str(in_place_retries)]
    return argv
