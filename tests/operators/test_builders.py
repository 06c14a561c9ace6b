"""The pure builders: every manifest validates against KubeRay's CRD schemas (../shared/kuberay/crds)
or the Kubernetes schemas, and carries what the issue asks for, checked field by field."""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from operators import admission, builders
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.crd import openapi_to_jsonschema
from rljob.graders import GRADER_SECRETS_DIR

KUBERAY = Path(__file__).resolve().parents[3] / "shared" / "kuberay" / "crds"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
K8S_VERSION = "1.33"


@functools.cache
def kuberay_validator(kind: str) -> Any:
    """A validator of KubeRay's CRD schema of ``kind``, the schema checked once: reading the CRD
    and checking its schema take seconds, validating a manifest milliseconds."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where built in: the CRD is large
    crd = yaml.load((KUBERAY / f"ray.io_{kind}.yaml").read_text(), Loader=loader)
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = openapi_to_jsonschema(v1["schema"]["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def rljob(path: str = "rljob-qwen-gpu.yaml", namespace: str = "team-a") -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((EXAMPLES / path).read_text())
    obj["metadata"].update(namespace=namespace, uid="0b5c2f9e-5a0c-4c43-9d1a-1d2f3e4a5b6c")
    return obj


def owner(obj: dict[str, Any]) -> dict[str, Any]:
    """The owner reference everything built for ``obj`` carries, written out: the RLJob as the
    controller, and no blockOwnerDeletion (it would need update on rljobs/finalizers where the
    OwnerReferencesPermissionEnforcement admission plugin runs)."""
    meta = obj["metadata"]
    return {
        "apiVersion": "fp8rl.io/v1alpha1",
        "kind": "RLJob",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def build(obj: dict[str, Any], **settings: Any) -> dict[str, Any]:
    return builders.rayjob(rl.RLJob.of(obj), OperatorSettings(**settings))


def groups(rayjob: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


@pytest.mark.parametrize("example", ["rljob-qwen-gpu.yaml", "rljob-arithmetic-cpu.yaml"])
def test_rayjob_validates_against_kuberay_crd(example: str) -> None:
    kuberay_validator("rayjobs").validate(build(rljob(example)))


@pytest.mark.parametrize("example", ["rljob-qwen-gpu.yaml", "rljob-arithmetic-cpu.yaml"])
def test_pod_templates_and_configmap_validate_as_kubernetes_objects(example: str) -> None:
    obj = rljob(example)
    cluster = build(obj)["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for i, template in enumerate(templates):
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}, "template": template}
        kubernetes_validate.validate(pod, desired_version=K8S_VERSION, strict=True)
    cm = builders.spec_configmap(rl.RLJob.of(obj))
    kubernetes_validate.validate(cm, desired_version=K8S_VERSION, strict=True)
    assert rl.spec_of({"spec": {"job": json.loads(cm["data"]["job.json"])}}).job == rl.spec_of(obj).job


def test_rayjob_fields() -> None:
    obj = rljob()
    body = build(obj, image="registry.example/fp8rl-worker:1.2", ttl_seconds_after_finished=99)
    spec = body["spec"]
    assert body["apiVersion"] == "ray.io/v1" and body["kind"] == "RayJob"
    assert body["metadata"]["name"] == "qwen-arith-fp8" and body["metadata"]["namespace"] == "team-a"
    assert spec["submissionMode"] == "HTTPMode" and spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == 99  # operator default (the example sets none)
    assert spec["activeDeadlineSeconds"] == 172800 and spec["backoffLimit"] == 2  # from the RLJob
    argv = shlex.split(spec["entrypoint"])
    assert argv[:4] == ["python", "-m", "workers.job.driver", "/etc/fp8rl/job.json"]
    assert "--resume" in argv and argv[argv.index("--output") + 1] == "/runs/qwen-arith-fp8"
    assert (
        argv[argv.index("--job") + 1] == "qwen-arith-fp8" and argv[argv.index("--namespace") + 1] == "team-a"
    )
    cluster = spec["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is False
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["no-monitor"] == "true" and head["rayStartParams"]["num-gpus"] == "0"
    head_pod = head["template"]["spec"]
    head_c = head_pod["containers"][0]
    assert "nvidia.com/gpu" not in head_c["resources"]["limits"]  # a CPU head
    assert {"name": "FP8RL_RAY_GROUPS", "value": "1"} in head_c["env"]
    assert {"name": "job-spec", "mountPath": "/etc/fp8rl"} in head_c["volumeMounts"]
    assert {"name": "job-spec", "configMap": {"name": "qwen-arith-fp8-spec"}} in head_pod["volumes"]
    for name, group in groups(body).items():
        pod = group["template"]["spec"]
        c = pod["containers"][0]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
        assert (
            c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        )
        assert group["rayStartParams"]["num-gpus"] == "1"
        custom = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert custom == {f"fp8rl_{name}": 1}
        assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["priorityClassName"] == "fp8rl-batch"
        assert c["image"] == "registry.example/fp8rl-worker:1.2"
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"name": "runs", "mountPath": "/runs"} in c["volumeMounts"]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in c["env"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
    # the queue: Kueue's label, and created suspended for Kueue to admit
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert spec["suspend"] is True
    assert body["metadata"]["ownerReferences"] == [owner(obj)]


def test_operator_defaults_fill_what_the_rljob_leaves_unset() -> None:
    obj = rljob("rljob-arithmetic-cpu.yaml")
    settings = {
        "generation": {"nodeSelector": {"pool": "gen"}},
        "training": {"nodeSelector": {"pool": "train"}},
    }
    body = build(obj, **settings)
    for name, group in groups(body).items():
        pod = group["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "gen" if name == "generation" else "train"}
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]  # a CPU job asks for none
        assert "priorityClassName" not in pod
    assert body["spec"]["suspend"] is False and "kueue.x-k8s.io/queue-name" not in body["metadata"]["labels"]
    assert body["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == (
        OperatorSettings().image
    )


@pytest.mark.parametrize(
    ("scheduler", "labels"),
    [
        ("volcano", {"ray.io/scheduler-name": "volcano", "volcano.sh/queue-name": "q1"}),
        ("kai", {"ray.io/scheduler-name": "kai-scheduler", "kai.scheduler/queue": "q1"}),
    ],
)
def test_queue_labels(scheduler: str, labels: dict[str, str]) -> None:
    obj = rljob()
    obj["spec"]["cluster"]["queue"] = {"scheduler": scheduler, "name": "q1"}
    body = build(obj)
    assert labels.items() <= body["metadata"]["labels"].items()
    assert body["spec"]["suspend"] is False  # only Kueue admits by unsuspending
    kuberay_validator("rayjobs").validate(body)


def test_spec_hash_changes_with_the_job_not_with_suspend() -> None:
    obj = rljob()
    base = builders.spec_hash(rl.spec_of(obj))
    obj["spec"]["suspend"] = True
    assert builders.spec_hash(rl.spec_of(obj)) == base
    obj["spec"]["job"]["steps"] = 501
    assert builders.spec_hash(rl.spec_of(obj)) != base


def test_the_builders_change_nothing_they_are_given() -> None:
    """Building twice from one RLJob gives the same objects, and leaves the RLJob and the settings
    as they were (no builder pops or updates what it was passed)."""
    obj = rljob()
    obj["spec"]["cluster"]["volumeClaim"] = "runs"  # a second extra volume
    job, settings = rl.RLJob.of(obj), OperatorSettings()
    before = (job.spec.model_dump(), settings.model_dump())
    first = (builders.rayjob(job, settings), builders.spec_configmap(job))
    assert (builders.rayjob(job, settings), builders.spec_configmap(job)) == first
    assert (job.spec.model_dump(), settings.model_dump()) == before
    head = first[0]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert [sorted(v) for v in head["volumes"]] == [  # Kubernetes' keys only
        ["emptyDir", "name"],  # /dev/shm
        ["emptyDir", "name"],  # /data, where the job works
        ["configMap", "name"],
        ["name", "persistentVolumeClaim"],
    ]
    assert [m["mountPath"] for m in head["containers"][0]["volumeMounts"]] == [
        "/dev/shm",
        "/data",
        "/etc/fp8rl",
        "/runs",
    ]


def test_the_kuberay_schema_catches_mistakes() -> None:
    """The validation above can fail: a group without its template, or a string where an int goes."""
    validator = kuberay_validator("rayjobs")
    body = build(rljob())
    del body["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    with pytest.raises(jsonschema.ValidationError, match="template"):
        validator.validate(body)
    body = build(rljob())
    body["spec"]["backoffLimit"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(body)


def test_operator_refuses_a_bad_config_before_starting(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fp8rl.cli import app

    bad = tmp_path / "defaults.yaml"
    bad.write_text("metrics_port: 0\nimage: registry.example/w:1\n")
    result = CliRunner().invoke(app, ["operator", "--config", str(bad)])
    assert result.exit_code == 2 and "metrics_port" in result.output
    bad.write_text("no_such_setting: 1\n")
    result = CliRunner().invoke(app, ["operator", "--config", str(bad)])
    assert result.exit_code == 2 and "no_such_setting" in result.output


def test_driver_actors_ask_for_what_their_group_advertises(monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder's rayStartParams and the driver's actor options must meet: same custom resource,
    same GPUs per actor; outside a RayJob built by the operator the actors ask for no group."""
    from workers.job.ray_cluster import actor_options

    obj = rljob()
    spec = rl.spec_of(obj)
    body = build(obj)
    head_env = body["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    for var in head_env:
        monkeypatch.setenv(var["name"], var["value"])
    for name, group in groups(body).items():
        advertised = json.loads(json.loads(group["rayStartParams"]["resources"]))
        opts = actor_options(spec.job, name)
        assert opts["resources"] == advertised
        assert opts["num_gpus"] == int(group["rayStartParams"]["num-gpus"])
    monkeypatch.delenv("FP8RL_RAY_GROUPS")
    assert "resources" not in actor_options(spec.job, "training")


def test_a_pod_asking_more_gpus_than_the_default_pool_has_is_refused() -> None:
    settings = OperatorSettings(generation_max_gpus_per_pod=4, training_max_gpus_per_pod=8)
    # vLLM splits its model over every GPU of a generator; a trainer uses one GPU, whatever its engine
    tp8 = {"generator_engine": "vllm", "gpus_per_generator": 8, "generator_tensor_parallel_size": 8}
    job = {"resources": {"generators": 2, "trainers": 1, **tp8, "gpus_per_trainer": 1}}
    spec = rl.RLJobSpec.model_validate({"job": job})
    [problem] = admission.placement_problems(spec, settings)
    assert problem.startswith("spec.job.resources.gpus_per_generator: 8 GPUs in one pod")
    assert "have 4" in problem and "spec.cluster.generation.nodeSelector" in problem
    # its own pool: the operator does not know that pool's nodes, so it does not refuse
    own = rl.RLJobSpec.model_validate({"job": job, "cluster": {"generation": {"nodeSelector": {"p": "big"}}}})
    assert admission.placement_problems(own, settings) == []
    # at the limit, and with no limit configured: fine
    job["resources"].update(gpus_per_generator=4, generator_tensor_parallel_size=4)
    assert admission.placement_problems(rl.RLJobSpec.model_validate({"job": job}), settings) == []
    job["resources"].update(gpus_per_generator=16, generator_tensor_parallel_size=16)
    assert admission.placement_problems(rl.RLJobSpec.model_validate({"job": job}), OperatorSettings()) == []


def test_the_operator_refuses_share_gpu() -> None:
    from operators.admission import placement_problems
    from operators.settings import OperatorSettings
    from rljob.resource import RLJobSpec

    # one GPU shared by every actor is for `fp8rl run` on one machine; pods get whole GPUs
    job = {"resources": {"share_gpu": True, "gpus_per_generator": 1, "gpus_per_trainer": 1}}
    problems = placement_problems(RLJobSpec.model_validate({"job": job}), OperatorSettings())
    assert problems and problems[0].startswith("spec.job.resources.share_gpu")


def test_files_outside_the_pods_data_are_refused_and_jobs_run_in_data() -> None:
    """The service's path rule (rljob.paths) for RLJobs created with kubectl: relative paths and
    Hugging Face ids resolve under /data, where the driver runs; absolute paths must be under /data
    or a read-only root of the operator's settings."""
    obj = rljob()  # model Qwen/Qwen2.5-1.5B-Instruct: relative, a Hugging Face id
    settings = OperatorSettings(model_roots=["/models"])
    assert admission.path_problems(rl.spec_of(obj), settings) == []
    for template in [build(obj)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]]:
        assert template["spec"]["containers"][0]["workingDir"] == "/data"
    obj["spec"]["job"]["task"] = {"dataset": "/etc/passwd"}
    obj["spec"]["job"]["model"] = {"name": "/models/../root/.cache/x", "pretrained": False}
    problems = admission.path_problems(rl.spec_of(obj), settings)
    assert [p.split(":")[0] for p in problems] == ["spec.job.task.dataset", "spec.job.model.name"]
    obj["spec"]["job"]["model"] = {"name": "/models/llama-8b"}  # a shared root
    obj["spec"]["job"]["task"] = {"dataset": "data/addition.jsonl"}
    assert admission.path_problems(rl.spec_of(obj), settings) == []


def pod_templates(rayjob: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod template of ``rayjob``: head, worker groups and (K8sJobMode) the submitter."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    out = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    if "submitterPodTemplate" in rayjob["spec"]:
        out.append(rayjob["spec"]["submitterPodTemplate"])
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a matchLabels-only ``selector`` selects ``labels`` (what the builders use)."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_every_ray_cluster_requires_a_token_through_kuberay_by_default() -> None:
    body = build(rljob())
    assert body["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    assert body["spec"]["submissionMode"] == "HTTPMode"  # KubeRay >= 1.5.1 submits with the token
    kuberay_validator("rayjobs").validate(body)
    for template in pod_templates(body):  # KubeRay sets the token's env itself
        assert not any(e["name"].startswith("RAY_AUTH") for e in template["spec"]["containers"][0]["env"])


def test_with_a_secret_every_container_and_the_submitter_carry_the_token() -> None:
    obj = rljob()
    job = rl.RLJob.of(obj)
    settings = OperatorSettings(ray_auth="secret", service_account="runner")
    body = builders.rayjob(job, settings)
    kuberay_validator("rayjobs").validate(body)
    assert "authOptions" not in body["spec"]["rayClusterSpec"]
    assert body["spec"]["submissionMode"] == "K8sJobMode"  # an older KubeRay cannot submit with it
    templates = pod_templates(body)
    assert len(templates) == 4  # head, generation, training, submitter
    # the name carries the RLJob's uid: no Secret that existed before the RLJob can be it
    token_name = f"qwen-arith-fp8-ray-token-{obj['metadata']['uid'][:8]}"
    secret_ref = {"secretKeyRef": {"name": token_name, "key": "auth_token"}}
    for i, template in enumerate(templates):
        env = template["spec"]["containers"][0]["env"]
        assert {"name": "RAY_AUTH_MODE", "value": "token"} in env
        assert {"name": "RAY_AUTH_TOKEN", "valueFrom": secret_ref} in env
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}, "template": template}
        kubernetes_validate.validate(pod, desired_version=K8S_VERSION, strict=True)
    submitter = body["spec"]["submitterPodTemplate"]["spec"]
    assert submitter["restartPolicy"] == "Never" and submitter["serviceAccountName"] == "runner"
    assert submitter["containers"][0]["image"] == OperatorSettings().image
    secret = builders.ray_token_secret(job, "t0k3n")
    kubernetes_validate.validate(secret, desired_version=K8S_VERSION, strict=True)
    assert secret["metadata"]["name"] == token_name and secret["stringData"] == {"auth_token": "t0k3n"}
    assert secret["metadata"]["ownerReferences"] == [owner(obj)]


def test_the_network_policy_admits_the_job_its_scrapers_and_kuberay_only() -> None:
    obj = rljob()
    job, settings = rl.RLJob.of(obj), OperatorSettings(metrics_port=9500)
    policy = builders.network_policy(job, settings)
    kubernetes_validate.validate(policy, desired_version=K8S_VERSION, strict=True)
    meta, spec = policy["metadata"], policy["spec"]
    assert (meta["name"], meta["namespace"]) == ("qwen-arith-fp8", "team-a")
    assert meta["ownerReferences"] == [owner(obj)]
    assert spec["policyTypes"] == ["Ingress"]
    # it selects every pod of the job (head, both groups, a submitter), and no other job's
    for ray_auth in ("kuberay", "secret"):
        for template in pod_templates(build(obj, ray_auth=ray_auth)):
            assert selects(spec["podSelector"], template["metadata"]["labels"])
    other = rljob()
    other["metadata"]["name"] = "other-job"
    for template in pod_templates(build(other)):
        assert not selects(spec["podSelector"], template["metadata"]["labels"])
    # no allow-all: every rule names its sources, and no source is "every namespace" or "anything"
    for rule in spec["ingress"]:
        assert rule.get("from"), rule
        for peer in rule["from"]:
            assert "ipBlock" not in peer and peer.get("namespaceSelector") != {}
            assert peer.get("podSelector") or peer.get("namespaceSelector"), peer
    own, metrics, dashboard = spec["ingress"]
    assert own == {
        "from": [{"podSelector": {"matchLabels": {"fp8rl.io/rljob": "qwen-arith-fp8"}}}]
    }  # any port
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert metrics["from"][0] == {
        "namespaceSelector": monitoring,
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    assert metrics["from"][1]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert dashboard["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        }
    ]
    # the ports are the head's: the driver's metrics and Ray's dashboard
    head = build(obj, metrics_port=9500)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert (
        metrics["ports"]
        == [{"port": ports["fp8rl-metrics"], "protocol": "TCP"}]
        == [{"port": 9500, "protocol": "TCP"}]
    )
    assert (
        dashboard["ports"]
        == [{"port": ports["dashboard"], "protocol": "TCP"}]
        == [{"port": 8265, "protocol": "TCP"}]
    )


def test_a_peer_for_every_namespace_is_refused() -> None:
    with pytest.raises(ValueError, match="empty namespaceSelector admits pods of every namespace"):
        OperatorSettings(
            dashboard_from=[{"namespaceSelector": {}, "podSelector": {"matchLabels": {"a": "b"}}}]
        )


def test_an_image_outside_the_allow_list_is_refused_naming_the_field() -> None:
    obj = rljob()  # names no image: the operator's default
    assert admission.image_problems(rl.spec_of(obj), OperatorSettings()) == []  # the default image
    obj["spec"]["cluster"]["image"] = "registry.example/fp8rl-worker-evil:1"
    settings = OperatorSettings(allowed_images=["registry.example/fp8rl-worker"])
    [problem] = admission.image_problems(rl.spec_of(obj), settings)
    assert problem.startswith("spec.cluster.image: 'registry.example/fp8rl-worker-evil:1' is not an allowed")
    assert "jobDefaults.allowedImages" in problem
    obj["spec"]["cluster"]["image"] = "registry.example/fp8rl-worker@sha256:" + "0" * 64
    assert admission.image_problems(rl.spec_of(obj), settings) == []
    # without a list: the operator's own image exactly, not another tag of its repository
    default = OperatorSettings()
    obj["spec"]["cluster"]["image"] = default.image
    assert admission.image_problems(rl.spec_of(obj), default) == []
    obj["spec"]["cluster"]["image"] = "ghcr.io/fp8rl/worker:0.9.9"
    assert admission.image_problems(rl.spec_of(obj), default) != []
    # a repository under an allowed one: only where the prefix ends in "/"
    obj["spec"]["cluster"]["image"] = "registry.example/fp8rl-worker/other:1"
    assert admission.image_problems(rl.spec_of(obj), settings) != []


def test_the_kuberay_crd_check_finds_auth_options() -> None:
    """KubeRay's CRD of the version we validate against has authOptions; a CRD without it (an
    older KubeRay) would prune the field and leave the Ray cluster without a token."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((KUBERAY / "ray.io_rayjobs.yaml").read_text(), Loader=loader)
    assert builders.kuberay_knows_auth_options(crd)
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    del v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["rayClusterSpec"]["properties"][
        "authOptions"
    ]
    assert not builders.kuberay_knows_auth_options(crd)
    assert not builders.kuberay_knows_auth_options({"spec": {"versions": [{"name": "v1alpha1"}]}})
    assert not builders.kuberay_knows_auth_options({})


def test_no_job_pod_mounts_a_service_account_token() -> None:
    """A job's code never calls the Kubernetes API: head, workers and submitter carry no token,
    with or without a service account named."""
    for settings in (OperatorSettings(), OperatorSettings(ray_auth="secret", service_account="runner")):
        templates = pod_templates(builders.rayjob(rl.RLJob.of(rljob()), settings))
        assert len(templates) >= 3
        assert all(t["spec"]["automountServiceAccountToken"] is False for t in templates)


JUDGE, SECRET, OTHER_KEY = "https://judge.example/score", {"name": "judge"}, {"name": "judge", "key": "b"}


def test_the_operator_mounts_the_token_secret_on_the_head_pod() -> None:
    job = rl.RLJob.of(
        {
            "apiVersion": rl.API_VERSION,
            "kind": rl.KIND,
            "metadata": {"name": "judged", "namespace": "team-a"},
            "spec": {
                "job": {
                    "task": {
                        "graders": [
                            {"type": "http", "name": "a", "url": JUDGE, "token_secret": SECRET},
                            {"type": "http", "name": "b", "url": JUDGE, "token_secret": OTHER_KEY},
                        ]
                    }
                }
            },
        }
    )  # fmt: skip
    body = builders.rayjob(job, OperatorSettings())
    head = body["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    volumes = [v for v in head["volumes"] if "secret" in v]
    assert volumes == [
        {"name": "grader-secret-0", "secret": {"secretName": "judge"}}
    ]  # one Secret, both keys
    [mount] = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == "grader-secret-0"]
    assert mount["mountPath"] == f"{GRADER_SECRETS_DIR}/judge"
    for group in body["spec"]["rayClusterSpec"]["workerGroupSpecs"]:  # the workers do not grade
        assert not [v for v in group["template"]["spec"]["volumes"] if "secret" in v]
