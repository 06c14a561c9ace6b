"""An RLJob of the SmolLM2 example (``examples/smollm2-addition.yaml``) on a pretrained model shipped
on the job's volume, through the real ``fp8rl operator`` on kmock, to a real Prometheus.

The RLJob mounts a ReadWriteMany volume (``spec.cluster.volumeClaim``, at ``/runs`` in every pod)
that holds the model directory, and names it ``/runs/models/smollm2-135m-instruct``; the operator
allows it because its ``model_roots`` (the chart's ``jobDefaults.modelRoots``) name ``/runs/models``.
The operator builds the RayJob; the test plays KubeRay (the head pod, the RayJob's status) and the
driver: it reads the spec the operator put in the ConfigMap, finds the model where the volume is on
this machine (the models cache of ``fp8rl model fetch``), runs ONE real step of the real model in
this process (:class:`~tests.workers.inprocess_actors.InProcessActors` and ``rl_step``, as the
driver's actors run it, minus Ray) and serves its metrics row on a real ``PromExporter``. The
operator mirrors the row into the RLJob's status, and a real Prometheus, scraping the exporter as
the chart's PodMonitor scrapes a head pod, holds the row's values under their ``fp8rl_*`` names.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import pytest
import torch
import yaml

from operators.builders import RUNS_DIR, SPEC_DIR, path_problems
from operators.settings import OperatorSettings
from rljob import metrics as m
from rljob import resource as rl
from rljob.paths import POD_HOME
from rljob.run_dir import JOB_SPEC, driver_argv
from rljob.spec import JobSpec
from tests.helm.monitoring import Prometheus, pod_monitor, scraping
from tests.helpers import wait_for
from tests.operators.test_operator_e2e import NS, RL, Cluster, running_cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-addition.yaml"
JOB = "smollm2"
CLAIM = "smollm2-models"  # the tenant's ReadWriteMany volume, holding models/smollm2-135m-instruct
POD_MODELS = PurePosixPath(RUNS_DIR) / "models"  # the operator's model root: models on the job's volume
POD_MODEL = POD_MODELS / "smollm2-135m-instruct"
RECIPE = "fp8-e2e"  # the example's


def example_job(model_name: str) -> dict[str, Any]:
    """``spec.job``: the example as a user ships it in an RLJob, with the model on the job's volume,
    the output next to it, and a batch the test's one real step can afford (2 prompts x 2
    responses; no validation, which the driver would run before step 1)."""
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    job["model"]["name"] = model_name
    job["output_dir"] = f"{RUNS_DIR}/smollm2-addition"
    job["rollout"].update(prompts_per_step=2, group_size=2)
    job["validation"]["interval"] = 0
    assert job["precision"]["recipe"] == RECIPE
    return job


def rljob(name: str, model_name: str) -> dict[str, Any]:
    body = rl.manifest(name, NS, JobSpec.model_validate(example_job(model_name)))
    body["spec"]["cluster"] = {"volumeClaim": CLAIM}
    return body


def test_a_model_on_the_jobs_volume_needs_the_operators_model_root() -> None:
    """The operator's confinement as text (its pods' files are out of its sight): ``/data`` and its
    ``model_roots`` only; the volume's ``/runs`` is not a root by itself, and ``..`` cannot climb out."""
    spec = rl.spec_of(rljob(JOB, str(POD_MODEL)))
    roots = OperatorSettings(model_roots=[str(POD_MODELS)])
    assert path_problems(spec, roots) == []
    [problem] = path_problems(spec, OperatorSettings())
    assert problem.startswith(f"spec.job.model.name: '{POD_MODEL}' leads outside the tenant's files")
    in_home = rl.spec_of(rljob(JOB, str(POD_HOME / "models" / "smollm2-135m-instruct")))
    assert path_problems(in_home, OperatorSettings()) == []
    climbs = rl.spec_of(rljob(JOB, f"{POD_MODELS}/../../etc/smollm2"))
    assert [p.split(":")[0] for p in path_problems(climbs, roots)] == ["spec.job.model.name"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """kmock and the operator (model root ``/runs/models``), whose driver metrics port is a real
    exporter labelled as the driver labels this job's metrics."""
    roots = {"FP8RL_OPERATOR_MODEL_ROOTS": json.dumps([str(POD_MODELS)])}
    with running_cluster(tmp_path, JOB, RECIPE, roots) as c:
        yield c


def _selected(labels: dict[str, str], selector: dict[str, Any]) -> bool:
    """Whether a label selector (matchLabels, and matchExpressions with ``Exists``) picks ``labels``."""
    expressions = selector.get("matchExpressions", [])
    assert {e["operator"] for e in expressions} <= {"Exists"}, expressions
    exists = all(e["key"] in labels for e in expressions)
    return exists and selector.get("matchLabels", {}).items() <= labels.items()


def one_real_step(spec: JobSpec) -> dict[str, Any]:
    """Step 1 of ``spec`` on the real model, as the driver runs it (its actors in this process):
    the generators start from the trainer's weights, then the RL loop's step 1; the row as the driver
    writes and exports it (with its fault counts)."""
    from tests.workers.inprocess_actors import InProcessActors
    from workers.rl_loop import RlLoop
    from workers.rl_step import sync_weights
    from workers.step_protocol import StepContext
    from workers.tasks import Task
    from workers.tokenizer import build_tokenizer

    threads = torch.get_num_threads()
    # each actor's threads on a 2-core node (workers.ray_workers): oversubscribed OpenMP threads crawl
    torch.set_num_threads(spec.resources.threads(2))
    try:
        tok = build_tokenizer(spec)
        task = Task.for_job(spec, tok)
        actors = InProcessActors(spec, tok)
        sync_weights(actors)
        outcome = RlLoop(StepContext(spec, task, tok, actors), 1).step(1)
        assert outcome.fault is None and outcome.row is not None, outcome.fault
        row = outcome.row
    finally:
        torch.set_num_threads(threads)
    return {**row, **dict.fromkeys(m.FAULT_KEYS, 0.0)}


@pytest.mark.slow
def test_the_example_rljob_on_a_pretrained_model_reaches_status_and_prometheus(
    cluster: Cluster, smollm2_dir: Path, tmp_path: Path
) -> None:
    c = cluster
    port = c.exporter.port  # type: ignore[attr-defined]
    c.objects.create_namespaced_custom_object(*RL, rljob(JOB, str(POD_MODEL)))
    [rayjob] = wait_for(c.rayjobs, "the RayJob")
    c.wait_phase(JOB, "Starting")

    # the driver's command carries the spec the operator shipped in the ConfigMap: the model on the volume
    spec_file = f"{SPEC_DIR}/{JOB_SPEC}"
    argv = driver_argv(
        spec_file, f"{RUNS_DIR}/smollm2-addition", job=JOB, namespace=NS, resume=True, metrics_port=port
    )
    assert rayjob["spec"]["entrypoint"] == shlex.join(argv)
    [cm] = [x for x in c.kube.objects("configmaps", NS) if x["metadata"]["name"] == f"{JOB}-spec"]
    shipped = JobSpec.model_validate_json(cm["data"][JOB_SPEC])
    assert shipped.model_dump() == JobSpec.model_validate(example_job(str(POD_MODEL))).model_dump()
    assert shipped.model.name == str(POD_MODEL) and shipped.tokenizer.name is None  # the model's own

    # its resources: a CPU head, one generator and one trainer pod (the example's, on CPU), and
    # the volume mounted at /runs in every pod, whose working directory is /data
    ray_cluster = rayjob["spec"]["rayClusterSpec"]
    head = ray_cluster["headGroupSpec"]
    groups = {g["groupName"]: g for g in ray_cluster["workerGroupSpecs"]}
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert [(n, g["replicas"], g["rayStartParams"]["num-gpus"]) for n, g in sorted(groups.items())] == [
        ("generation", 1, "0"),
        ("training", 1, "0"),
    ]
    for group in groups.values():
        [container] = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["cpu"] == "1"
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
    for template in [head["template"], *(g["template"] for g in groups.values())]:
        pod = template["spec"]
        [container] = pod["containers"]
        assert container["workingDir"] == str(POD_HOME)
        [volume] = [v for v in pod["volumes"] if v.get("persistentVolumeClaim")]
        assert volume["persistentVolumeClaim"] == {"claimName": CLAIM}
        assert {"name": volume["name"], "mountPath": RUNS_DIR} in container["volumeMounts"]
    # the chart's PodMonitor picks the head pod and its metrics port by name
    monitor = pod_monitor()
    assert _selected(head["template"]["metadata"]["labels"], monitor["spec"]["selector"])
    [head_container] = head["template"]["spec"]["containers"]
    [metrics_port] = [p for p in head_container["ports"] if p["name"] == "fp8rl-metrics"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "fp8rl-metrics"
    assert metrics_port["containerPort"] == port

    # KubeRay: the head pod is up and the driver runs
    head_pod: Any = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{JOB}-head", "namespace": NS}}
    head_pod["metadata"]["labels"] = head["template"]["metadata"]["labels"] | {
        "ray.io/cluster": f"{JOB}-raycluster",
        "ray.io/node-type": "head",
    }
    head_pod["status"] = {"podIP": "127.0.0.1", "phase": "Running"}
    c.core.create_namespaced_pod(NS, head_pod)
    c.kuberay(JOB, jobDeploymentStatus="Running", jobStatus="RUNNING", rayClusterName=f"{JOB}-raycluster")
    c.wait_phase(JOB, "Running")

    # the driver: the shipped spec, its volume's models directory being the fetched cache here
    here = smollm2_dir.parent / POD_MODEL.relative_to(POD_MODELS)
    local = shipped.model_copy(update={"model": shipped.model.model_copy(update={"name": str(here)})})
    started = time.monotonic()
    row = one_real_step(local)
    print(f"one real step of {JOB} ({RECIPE}): {time.monotonic() - started:.0f} s; {row}")
    c.exporter.observe(row)  # type: ignore[attr-defined]
    assert row["step"] == 1 and 0.0 <= row[m.REWARD_MEAN] <= 1.0
    assert 0.0 <= row[m.RESPONSE_TRUNCATED_FRACTION] <= 1.0

    # the operator mirrors it into the RLJob's status
    def progress() -> dict[str, Any]:
        found: dict[str, Any] = ((c.rljob(JOB) or {}).get("status") or {}).get("progress") or {}
        return found

    got = wait_for(progress, "progress at step 1", lambda p: p.get("step") == 1)
    assert (got["reward"], got["total_steps"]) == (row[m.REWARD_MEAN], shipped.steps)
    assert got["token_mult_prob_error"] == row[m.TOKEN_MULT_PROB_ERROR]

    # a real Prometheus scraping the exporter as the PodMonitor scrapes the head pod holds the row
    target = f"127.0.0.1:{port}"
    with scraping(tmp_path / "prometheus", target) as url, httpx.Client() as http:

        def query(expr: str) -> list[tuple[dict[str, str], float]]:
            return [(s.labels, s.value) for s in Prometheus(url, time.time(), target, "", http).query(expr)]

        selector = f'{{job="{JOB}"}}'
        wait_for(lambda: query(f"fp8rl_step{selector}"), "Prometheus to hold the step", timeout=60)
        for name, key in (
            ("fp8rl_step", m.STEP),
            ("fp8rl_reward_mean", m.REWARD_MEAN),
            ("fp8rl_response_truncated_fraction", m.RESPONSE_TRUNCATED_FRACTION),
            ("fp8rl_response_unreadable_fraction", m.RESPONSE_UNREADABLE_FRACTION),
        ):
            assert [p.name for p in m.PROMETHEUS if p.key == key] == [name]
            [(labels, value)] = query(f"{name}{selector}")
            assert (labels["namespace"], labels["recipe"]) == (NS, RECIPE), labels
            assert value == float(row[key]), (name, value, row[key])

    # the same RLJob naming the model where it lies on this machine, or climbing out of the root,
    # is refused by the operator: no RayJob, Failed with the field
    c.objects.create_namespaced_custom_object(*RL, rljob("host-path", str(smollm2_dir)))
    c.objects.create_namespaced_custom_object(*RL, rljob("climbs", f"{POD_MODELS}/../../etc/smollm2"))
    for name in ("host-path", "climbs"):
        failed = c.wait_phase(name, "Failed")
        assert failed["status"]["reason"] == "InvalidSpec"
        assert failed["status"]["message"].startswith("spec.job.model.name: "), failed["status"]
    assert [r["metadata"]["name"] for r in c.rayjobs()] == [JOB]
