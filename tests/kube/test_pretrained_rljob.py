"""An RLJob of the SmolLM2 example (``examples/smollm2-addition.yaml``) on a pretrained model shipped
on the job's volume, through the chart's operator and the real KubeRay on the test cluster
(tests/kube), to a real Prometheus that finds the head pod as the chart's PodMonitor does.

The RLJob mounts a ReadWriteMany volume (``spec.cluster.volumeClaim``, at ``/runs`` in every pod)
that holds the model directory, and names it ``/runs/models/smollm2-135m-instruct``; the operator
allows it because its ``model_roots`` (the chart's ``jobDefaults.modelRoots``, set by the test
install) name ``/runs/models``. The claim is bound to a volume an admin made, so the pods schedule.
The operator builds the RayJob and KubeRay its pods; the test plays the driver (the one simulated
part, tests/kube/README.md): it reads the spec the operator put in the ConfigMap, finds the model
where the volume is on this machine (here SmolLM2's tokenizer on 2 random layers: the plumbing is
under test, tests/workers/test_smollm2.py runs the real weights), runs ONE real step in this
process (:class:`~tests.workers.inprocess_actors.InProcessActors` and ``workers.rl.step``, as the
driver's actors run it, minus Ray) and serves its metrics row on a real
``PromExporter`` behind the head pod. The operator mirrors the row into the RLJob's status, and
Prometheus, discovering the head pod through the API server, holds the row's values under their
``fp8rl_*`` names.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
import yaml

from operators.admission import path_problems
from operators.builders import RUNS_DIR, SPEC_DIR
from operators.settings import OperatorSettings
from rljob import metrics as m
from rljob import resource as rl
from rljob.paths import POD_HOME
from rljob.prometheus import PROMETHEUS
from rljob.run_dir import JOB_SPEC, driver_argv
from rljob.spec import JobSpec
from tests.helpers import wait_for
from tests.kube import install, prometheus
from tests.kube.cluster import KubeCluster, wait_object
from tests.kube.jobs import Jobs, tenant_kubeconfig
from tests.kube.podnet import PodNetwork

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2-addition.yaml"
NS = "team-c"
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


def volume(kube: KubeCluster) -> None:
    """What an admin provides: a ReadWriteMany volume and the tenant's claim bound to it."""
    kube.apply({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{NS}-{CLAIM}"},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "hostPath": {"path": "/srv/models"}, "claimRef": {"namespace": NS, "name": CLAIM}},
    })  # fmt: skip
    kube.apply({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": NS},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"{NS}-{CLAIM}",
                 "resources": {"requests": {"storage": "10Gi"}}},
    })  # fmt: skip
    wait_for(
        lambda: kube.get("pvc", CLAIM, NS),
        "the claim bound",
        lambda c: (c or {}).get("status", {}).get("phase") == "Bound",
    )


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
    from workers.models.tokenizer import build_tokenizer
    from workers.rl.loop import RlLoop
    from workers.rl.protocol import StepContext
    from workers.rl.step import sync_weights
    from workers.tasks import Task

    threads = torch.get_num_threads()
    # each actor's threads on a 2-core node (workers.job.ray_workers): oversubscribed OpenMP threads crawl
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
    kube: KubeCluster, operator: install.Process, podnet: PodNetwork, smollm2_small_dir: Path, tmp_path: Path
) -> None:
    jobs = Jobs(kube, NS, tenant_kubeconfig(kube, NS, tmp_path))
    volume(kube)
    body = rljob(JOB, str(POD_MODEL))
    kube.kubectl("apply", "-n", NS, "-f", "-", kubeconfig=jobs.tenant, input=json.dumps(body))
    rayjob = wait_object(lambda: jobs.rayjob(JOB), "the RayJob")
    port = OperatorSettings().metrics_port  # the chart's jobDefaults.metricsPort, its default

    # the driver's command carries the spec the operator shipped in the ConfigMap: the model on the volume
    argv = driver_argv(
        f"{SPEC_DIR}/{JOB_SPEC}", f"{RUNS_DIR}/smollm2-addition", job=JOB, namespace=NS, resume=True,
        metrics_port=port, metrics_linger=10,  # rayAuth secret: three 1 s polls, but at least 10 s
        in_place_retries=2,  # the chart's jobDefaults.inPlaceRetries
    )  # fmt: skip
    assert rayjob["spec"]["entrypoint"] == shlex.join(argv)
    configmap = kube.get("configmap", f"{JOB}-spec", NS) or {}
    shipped = JobSpec.model_validate_json(configmap["data"][JOB_SPEC])
    assert shipped.model_dump() == JobSpec.model_validate(example_job(str(POD_MODEL))).model_dump()
    assert shipped.model.name == str(POD_MODEL) and shipped.tokenizer.name is None  # the model's own

    # KubeRay's pods: a CPU head, one generator and one trainer pod (the example's, on CPU), the
    # volume mounted at /runs in every one, whose working directory is /data
    pods = wait_for(
        lambda: jobs.pods(JOB),
        "head, workers and submitter Running",
        lambda ps: len(ps) == 4 and all(p["status"].get("phase") == "Running" for p in ps),
        timeout=90,
    )
    ray_pods = [p for p in pods if p["metadata"]["labels"]["fp8rl.io/group"] != "submitter"]
    assert sorted(p["metadata"]["labels"]["fp8rl.io/group"] for p in ray_pods) == [
        "generation",
        "head",
        "training",
    ]
    for pod in ray_pods:
        [container] = pod["spec"]["containers"]
        assert container["workingDir"] == str(POD_HOME)
        if pod["metadata"]["labels"]["fp8rl.io/group"] != "head":
            assert container["resources"]["limits"]["cpu"] == "1"
            assert "nvidia.com/gpu" not in container["resources"]["limits"]
        [claim] = [v for v in pod["spec"]["volumes"] if v.get("persistentVolumeClaim")]
        assert claim["persistentVolumeClaim"] == {"claimName": CLAIM}
        assert any(
            mt["name"] == claim["name"] and mt["mountPath"] == RUNS_DIR for mt in container["volumeMounts"]
        )

    # the driver: the shipped spec, the model on its volume being the 2-layer copy here
    driver = podnet.run_driver(NS, JOB, RECIPE)
    small = shipped.model.model_copy(update={"name": str(smollm2_small_dir)})
    local = shipped.model_copy(update={"model": small})
    started = time.monotonic()
    row = one_real_step(local)
    print(f"one real step of {JOB} ({RECIPE}): {time.monotonic() - started:.0f} s; {row}")
    driver.exporter.observe(row)
    assert row["step"] == 1

    # the operator mirrors it into the RLJob's status
    got = wait_for(
        lambda: jobs.status(JOB).get("progress") or {}, "progress at step 1", lambda p: p.get("step") == 1
    )
    assert (got["reward"], got["total_steps"]) == (row[m.REWARD_MEAN], shipped.steps)
    assert got["token_mult_prob_error"] == row[m.TOKEN_MULT_PROB_ERROR]

    # Prometheus, discovering pods through the API server with the chart's PodMonitor, holds the row
    with prometheus.prometheus(kube, tmp_path / "prometheus", podnet.url) as url:
        selector = f'{{job="{JOB}"}}'
        found = wait_for(
            lambda: prometheus.query(url, f"fp8rl_step{selector}"), "Prometheus to hold the step", timeout=60
        )
        [(labels, _)] = found
        head = next(p for p in ray_pods if p["metadata"]["labels"]["fp8rl.io/group"] == "head")
        assert labels["pod"] == head["metadata"]["name"]  # found by discovery: the head pod, nothing else
        for name, key in (
            ("fp8rl_step", m.STEP),
            ("fp8rl_reward_mean", m.REWARD_MEAN),
            ("fp8rl_response_truncated_fraction", m.RESPONSE_TRUNCATED_FRACTION),
            ("fp8rl_response_unreadable_fraction", m.RESPONSE_UNREADABLE_FRACTION),
        ):
            assert [p.name for p in PROMETHEUS if p.key == key] == [name]
            [(labels, value)] = prometheus.query(url, f"{name}{selector}")
            assert (labels["namespace"], labels["recipe"]) == (NS, RECIPE), labels
            assert value == float(row[key]), (name, value, row[key])

    # the same RLJob naming the model where it lies on this machine, or climbing out of the root,
    # is refused by the operator: no RayJob, Failed with the field
    for name, model in (("host-path", str(smollm2_small_dir)), ("climbs", f"{POD_MODELS}/../../etc/smollm2")):
        kube.kubectl(
            "apply", "-n", NS, "-f", "-", kubeconfig=jobs.tenant, input=json.dumps(rljob(name, model))
        )
    for name in ("host-path", "climbs"):
        failed = jobs.wait_phase(name, "Failed")
        assert failed["reason"] == "InvalidSpec"
        assert failed["message"].startswith("spec.job.model.name: "), failed
        assert jobs.rayjob(name) is None
        jobs.delete(name)
    jobs.delete(JOB)
    podnet.finish(NS, JOB)
