"""``fp8rl bench operator``: how long N RLJobs take to have their RayJobs, on kmock.

One run measures, each against a fresh in-memory API server:
- baseline: the bare API work the operator cannot avoid, done by one client directly (per job:
  read the RLJob, create a NetworkPolicy, a ConfigMap and a RayJob from the builders, write the
  status);
- operator: the same N RLJobs created at once, then the time until every one has its RayJob
  (each job's latency from its create to its RayJob first being seen, polled every 250 ms).

It prints both and their ratio. kmock is a development dependency (``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NS = "bench"
BASE_NS = "baseline"


@dataclass
class OperatorBench:
    jobs: int
    baseline_s: float
    operator_s: float
    latencies_s: list[float]
    startup_s: float

    def table(self) -> str:
        lat = sorted(self.latencies_s)
        p50 = statistics.median(lat)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        rows = [
            f"RLJobs: {self.jobs}   operator start (first RayJob of a probe job): {self.startup_s:.2f} s",
            f"{'what':<44}{'seconds':>10}",
            f"{'baseline: the API calls, one direct client':<44}{self.baseline_s:>10.2f}",
            f"{'operator: all RayJobs present':<44}{self.operator_s:>10.2f}",
            f"{'operator / baseline':<44}{self.operator_s / self.baseline_s:>9.1f}x",
            f"per job, create -> RayJob: p50 {p50:.2f} s, p99 {p99:.2f} s",
        ]
        return "\n".join(rows)


def _baseline(kube: Any, n: int) -> float:
    from kubernetes import client

    from operators import builders
    from operators.settings import OperatorSettings
    from rljob import resource as rl
    from rljob.kube import KubernetesJobStore, api_client
    from rljob.spec import JobSpec

    api = api_client(str(kube.kubeconfig))
    objects: Any = client.CustomObjectsApi(api)
    core: Any = client.CoreV1Api(api)
    networking: Any = client.NetworkingV1Api(api)
    store, settings = KubernetesJobStore(api), OperatorSettings()
    bodies = [rl.manifest(f"base-{i}", BASE_NS, JobSpec()) for i in range(n)]
    for body in bodies:
        objects.create_namespaced_custom_object(rl.GROUP, rl.VERSION, BASE_NS, rl.PLURAL, body)
    start = time.perf_counter()
    for body in bodies:
        name = body["metadata"]["name"]
        obj: Any = objects.get_namespaced_custom_object(rl.GROUP, rl.VERSION, BASE_NS, rl.PLURAL, name)
        job = rl.RLJob.of(obj)
        networking.create_namespaced_network_policy(BASE_NS, builders.network_policy(job, settings))
        core.create_namespaced_config_map(BASE_NS, builders.spec_configmap(job))
        objects.create_namespaced_custom_object(
            "ray.io", "v1", BASE_NS, "rayjobs", builders.rayjob(job, settings)
        )
        store.write_status(BASE_NS, name, lambda s: s)
    return time.perf_counter() - start


def stop(proc: Any, timeout_s: float = 20.0) -> None:
    """SIGTERM (kopf finishes its handlers, uvicorn its requests), then SIGKILL if it takes more
    than ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(jobs: int = 100, workdir: Path | None = None, verbose: bool = False) -> OperatorBench:
    from kubernetes import client

    from bench.kube_emulator import KubeEmulator, start_operator, wait_for
    from rljob import resource as rl
    from rljob.kube import api_client
    from rljob.spec import JobSpec

    with tempfile.TemporaryDirectory() as tmp:
        root = workdir or Path(tmp)
        (root / "baseline").mkdir(exist_ok=True)
        with KubeEmulator(root / "baseline", namespaces=[BASE_NS]) as kube:  # an API of its own
            baseline = _baseline(kube, jobs)
        with KubeEmulator(root, namespaces=[NS]) as kube:
            api = api_client(str(kube.kubeconfig))
            objects = client.CustomObjectsApi(api)

            def rayjobs() -> set[str]:
                return {o["metadata"]["name"] for o in kube.objects("rayjobs", NS)}

            t0 = time.perf_counter()
            operator = start_operator(
                kube.kubeconfig, root / "operator.log", {"FP8RL_OPERATOR_POLL_SECONDS": "30"}
            )
            try:
                probe = rl.manifest("probe", NS, JobSpec())
                objects.create_namespaced_custom_object(rl.GROUP, rl.VERSION, NS, rl.PLURAL, probe)
                wait_for(lambda: "probe" in rayjobs(), "the operator to start", timeout=120)
                startup = time.perf_counter() - t0
                names = [f"job-{i:04d}" for i in range(jobs)]
                created: dict[str, float] = {}

                def create(name: str) -> None:
                    body = rl.manifest(name, NS, JobSpec())
                    objects.create_namespaced_custom_object(rl.GROUP, rl.VERSION, NS, rl.PLURAL, body)
                    created[name] = time.perf_counter()

                seen: dict[str, float] = {}
                start = time.perf_counter()
                with ThreadPoolExecutor(8) as pool:
                    pool.map(create, names)
                    deadline = start + 600
                    while len(seen) < jobs and time.perf_counter() < deadline:
                        now = time.perf_counter()
                        for name in rayjobs() - seen.keys():
                            if name in created:
                                seen[name] = now
                        time.sleep(0.25)  # polling kmock in-process competes with it for the GIL
                total = time.perf_counter() - start
                if len(seen) < jobs:
                    raise TimeoutError(f"only {len(seen)} of {jobs} RayJobs after 600 s")
            finally:
                stop(operator)
    return OperatorBench(jobs, baseline, total, [seen[n] - created[n] for n in names], startup)
