"""Status is written only when a field changes: ``fp8rl operator`` as a real process on kmock,
configured with ``--config`` (a short ``poll_seconds``), a job held in Running with its driver's
progress unchanged; kmock's request log counts the status PATCHes of the RLJob over idle ticks."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from bench.kube_emulator import KubeEmulator, start_operator
from rljob import resource as rl
from rljob.kube import api_client
from rljob.spec import JobSpec
from tests.helpers import wait_for
from workers.prom_exporter import PromExporter

NS = "team-a"
POLL = 0.3  # seconds between the timer's reconciles


def test_idle_ticks_write_no_status(tmp_path: Path) -> None:
    exporter = PromExporter(job="idle", namespace=NS, recipe="fp8-e2e")
    port = exporter.serve(0, addr="127.0.0.1")
    config = tmp_path / "operator.yaml"
    config.write_text(yaml.safe_dump({"poll_seconds": POLL, "metrics_port": port}))
    with KubeEmulator(tmp_path, namespaces=[NS]) as kube:
        api = api_client(str(kube.kubeconfig))
        objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        log = tmp_path / "operator.log"
        operator = start_operator(kube.kubeconfig, log, extra_args=["--config", str(config)])
        try:
            body = rl.manifest("idle", NS, JobSpec(steps=10))
            objects.create_namespaced_custom_object(rl.GROUP, rl.VERSION, NS, rl.PLURAL, body)
            wait_for(lambda: kube.objects("rayjobs", NS), "the RayJob")
            # play KubeRay (the driver runs) and the driver (step 4 on its metrics endpoint)
            head: Any = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "idle-head"}}
            head["metadata"]["labels"] = {"ray.io/cluster": "idle-raycluster", "ray.io/node-type": "head"}
            head["status"] = {"podIP": "127.0.0.1", "phase": "Running"}
            core.create_namespaced_pod(NS, head)
            exporter.observe({"step": 4, "reward/mean": 0.5})
            running = {
                "jobDeploymentStatus": "Running",
                "jobStatus": "RUNNING",
                "rayClusterName": "idle-raycluster",
            }
            objects.patch_namespaced_custom_object_status(
                "ray.io", "v1", NS, "rayjobs", "idle", {"status": running}
            )

            def status() -> dict[str, Any]:
                [obj] = [o for o in kube.objects("rljobs", NS) if o["metadata"]["name"] == "idle"]
                return dict(obj.get("status") or {})

            wait_for(lambda: status().get("phase") == "Running", "Running")
            wait_for(lambda: status()["progress"]["step"] == 4, "progress step 4")
            time.sleep(4 * POLL)  # reconciles already under way finish

            def writes() -> int:
                return len(kube.requests("PATCH", "rljobs", "idle", "status"))

            def reads() -> int:
                return len(kube.requests("GET", "rljobs", "idle"))

            writes_before, reads_before, seen = writes(), reads(), status()
            time.sleep(12 * POLL)
            assert reads() - reads_before >= 6, "the operator did not reconcile on its timer"
            assert writes() == writes_before, "idle ticks wrote the status"
            assert status() == seen

            # a new step is a change: written once, then nothing again
            exporter.observe({"step": 5, "reward/mean": 0.75})
            wait_for(lambda: status()["progress"]["step"] == 5, "progress step 5")
            time.sleep(8 * POLL)
            assert writes() == writes_before + 1
            assert status()["progress"]["reward"] == 0.75
        finally:
            operator.send_signal(signal.SIGTERM)
            operator.wait(timeout=30)
            exporter.stop()
            print(log.read_text()[-4000:])
