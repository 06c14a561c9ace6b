"""The chart with the real helm: lint, render with default and GPU-cluster values, validate every
object (kubernetes-validate for built-in kinds, the Prometheus Operator's schemas for monitors and
rules, our CRD schema for RLJobs), each toggle, least-privilege RBAC, and agreement with what the
code expects (the operator's config model, the control plane's settings, the head pods the
operator builds, the tokens file format)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from operators import builders
from operators.settings import OperatorSettings
from rljob import resource as rl
from rljob.crd import openapi_to_jsonschema
from rljob.jobs import Limits
from service.settings import Settings
from tests.helm.tools import CHART, ROOT, by_kind, render, render_error, run, tool, validate_monitoring

K8S_VERSION = "1.33"
GPU_VALUES = ROOT / "examples" / "helm-values-gpu.yaml"
MONITORING = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
WITH_PROM = ("--api-versions", "monitoring.coreos.com/v1")


def validate_all(objects: list[dict[str, Any]]) -> None:
    """Every object valid: built-in kinds with kubernetes-validate (strict: unknown fields are
    errors), monitoring.coreos.com kinds with the Prometheus Operator's schemas."""
    problems = []
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {err.message} at {list(err.path)}")
    problems += validate_monitoring(
        [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
    )
    assert problems == []


def env_of(deployment: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [obj] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def test_helm_lint_with_default_and_gpu_values() -> None:
    for extra in ([], ["--values", str(GPU_VALUES)]):
        done = run([tool("helm"), "lint", "--strict", str(CHART), *extra])
        assert done.returncode == 0, done.stdout + done.stderr


def test_default_render_validates_and_has_the_parts() -> None:
    objects = render()
    validate_all(objects)
    kinds = by_kind(objects)
    assert not any(k in kinds for k in MONITORING)  # no monitoring.coreos.com API on this "cluster"
    assert [d["metadata"]["name"] for d in kinds["Deployment"]] == ["fp8rl-api", "fp8rl-operator"]
    assert {s["metadata"]["name"] for s in kinds["ServiceAccount"]} == {"fp8rl-api", "fp8rl-operator"}
    assert [s["metadata"]["name"] for s in kinds["Secret"]] == ["fp8rl-tokens"]
    assert "Ingress" not in kinds and "Namespace" not in kinds and "PersistentVolumeClaim" not in kinds
    assert len(kinds["NetworkPolicy"]) == 2 and len(kinds["PodDisruptionBudget"]) == 1
    assert len(kinds["ConfigMap"]) == 2  # the operator's config and the Grafana dashboard


def test_gpu_cluster_values_render_valid_objects_that_the_code_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = yaml.safe_load(GPU_VALUES.read_text())
    objects = render("--values", str(GPU_VALUES))
    validate_all(objects)
    kinds = by_kind(objects)
    assert set(MONITORING) <= set(kinds)  # monitoring.enabled: true, with or without the API
    assert {n["metadata"]["name"] for n in kinds["Namespace"]} == {"team-a", "team-b"}
    assert "Secret" not in kinds  # auth.existingSecret

    # the operator's config file loads into the model the operator reads (extra="forbid")
    config = named(objects, "ConfigMap", "fp8rl-operator")["data"]["config.yaml"]
    (tmp_path / "config.yaml").write_text(config)
    settings = OperatorSettings.load(tmp_path / "config.yaml")
    worker = values["images"]["worker"]
    assert settings.image == f"{worker['repository']}:{worker['tag']}"  # the example's own registry
    assert settings.ray_auth == "secret"  # the example says which KubeRay it is for
    assert settings.in_place_retries == 2 and settings.progress_route == "pod-ip"  # in the cluster
    assert settings.generation.node_selector == values["gpuPools"]["generation"]["nodeSelector"]
    assert settings.training.node_selector == values["gpuPools"]["training"]["nodeSelector"]
    assert [t.key for t in settings.generation.tolerations or []] == ["nvidia.com/gpu"]
    assert settings.generation_max_gpus_per_pod == 8 and settings.training_max_gpus_per_pod == 8
    assert settings.worker_memory == "200Gi" and settings.shm_size == "64Gi" and settings.backoff_limit == 2
    assert settings.nccl_env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert settings.metrics_port == 9400 and settings.active_deadline_seconds == 259200

    # the control plane's environment loads into its Settings, with the tenants' limits
    api = named(objects, "Deployment", "fp8rl-api")
    env = env_of(api)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = Settings()
    assert s.store == "kubernetes" and s.host == "0.0.0.0"
    assert (
        s.limits("team-a") == Limits(8, 64, 1000, 64 << 20)
        and s.limits("team-b") == Limits(4, 16, 1000, 64 << 20)
        and s.limits("other") == Limits(4, 8, 1000, 64 << 20)
    )
    volumes = {v["name"]: v for v in api["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tokens"]["secret"]["secretName"] == "fp8rl-tokens"

    # the operator watches the two tenants through RoleBindings there, not cluster-wide
    args = named(objects, "Deployment", "fp8rl-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    # and the control plane writes RLJobs there alone; it lists them cluster-wide
    assert {(b["metadata"]["namespace"], b["roleRef"]["name"]) for b in kinds["RoleBinding"]} == {
        ("team-a", "fp8rl-operator"),
        ("team-b", "fp8rl-operator"),
        ("team-a", "fp8rl-api"),
        ("team-b", "fp8rl-api"),
    }
    assert [b["metadata"]["name"] for b in kinds["ClusterRoleBinding"]] == [
        "fp8rl-api-list",
        "fp8rl-operator-discovery",
    ]
    assert rules(named(objects, "ClusterRole", "fp8rl-api-list")) == {
        ("fp8rl.io", "rljobs", "list"),
        ("fp8rl.io", "rljobs", "watch"),
    }

    [ingress] = kinds["Ingress"]
    assert ingress["spec"]["tls"] == [{"hosts": ["fp8rl.example.com"], "secretName": "fp8rl-tls"}]
    dashboard = named(objects, "ConfigMap", "fp8rl-dashboard")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    for monitor in kinds["ServiceMonitor"] + kinds["PodMonitor"] + kinds["PrometheusRule"]:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_crd_validates_and_its_schema_accepts_the_example_rljobs() -> None:
    objects = render("--include-crds")
    [crd] = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    schema = openapi_to_jsonschema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    examples = sorted((ROOT / "examples").glob("rljob-*.yaml"))
    assert len(examples) >= 2
    for path in examples:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    bad = yaml.safe_load(examples[0].read_text())
    bad["spec"]["suspend"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    ("setting", "api", "rendered"),
    [("auto", False, False), ("auto", True, True), ("false", True, False), ("true", False, True)],
)
def test_monitoring_renders_when_the_api_exists_or_forced(setting: str, api: bool, rendered: bool) -> None:
    value: Any = {"auto": "auto", "false": False, "true": True}[setting]
    objects = render(*(WITH_PROM if api else ()), values={"monitoring": {"enabled": value}})
    kinds = by_kind(objects)
    assert all((k in kinds) is rendered for k in MONITORING)
    if rendered:
        validate_all(objects)


def test_a_bad_value_fails_naming_the_key() -> None:
    assert "monitoring.enabled must be auto, true or false" in render_error(
        values={"monitoring": {"enabled": "yes"}}
    )
    assert 'controlPlane.store must be "kubernetes" or "sql"' in render_error(
        values={"controlPlane": {"store": "etcd"}}
    )
    sql_two = render_error(values={"controlPlane": {"store": "sql", "replicas": 2}})
    assert "controlPlane.replicas must be 1 with controlPlane.store=sql" in sql_two
    assert "is not a DNS label" in render_error(values={"tenants": [{"name": "Team_A"}]})
    assert "shorter than 16 characters" in render_error(values={"auth": {"tokens": {"short": "default"}}})


def test_ingress_toggle() -> None:
    assert "Ingress" not in by_kind(render())
    objects = render(values={"ingress": {"enabled": True, "host": "rl.example.org"}})
    validate_all(objects)
    [ingress] = by_kind(objects)["Ingress"]
    assert ingress["spec"]["rules"][0]["host"] == "rl.example.org" and "tls" not in ingress["spec"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "fp8rl-api", "port": {"name": "http"}}
    # that Service carries the API port only: the metrics port (tenant names) is not routed
    service = named(objects, "Service", "fp8rl-api")
    assert [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]] == [("http", "http")]
    assert all(
        p["backend"]["service"]["name"] != "fp8rl-api-metrics"
        for p in ingress["spec"]["rules"][0]["http"]["paths"]
    )


def test_tokens_secret_given_or_existing_and_never_minted_without_a_cluster() -> None:
    tenants = [{"name": "team-a", "createNamespace": True}, {"name": "team-b"}]
    # generated: only against a cluster that keeps them (tests/kube/test_upgrade.py); a render
    # without one (helm template, a GitOps tool) would mint new tokens each time, so it is refused
    error = render_error(values={"tenants": tenants, "auth": {"tokens": {}}})
    assert "auth: no cluster to keep generated tokens in" in error and "auth.existingSecret" in error
    # given
    given = {"a-very-long-token-for-a": "team-a"}
    [secret] = by_kind(render(values={"tenants": tenants, "auth": {"tokens": given}}))["Secret"]
    assert yaml.safe_load(base64.b64decode(secret["data"]["tokens.yaml"])) == given
    # an existing Secret: none rendered, the pod mounts that one
    objects = render(values={"auth": {"existingSecret": "my-tokens"}})
    assert "Secret" not in by_kind(objects)
    volumes = named(objects, "Deployment", "fp8rl-api")["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "tokens",
        "secret": {"secretName": "my-tokens", "items": [{"key": "tokens.yaml", "path": "tokens.yaml"}]},
    } in volumes


def test_sql_store_gets_one_replica_a_volume_and_no_kubernetes_rights() -> None:
    objects = render(values={"controlPlane": {"store": "sql", "replicas": 1}})
    validate_all(objects)
    kinds = by_kind(objects)
    api = named(objects, "Deployment", "fp8rl-api")
    assert api["spec"]["strategy"] == {"type": "Recreate"}
    assert api["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    [pvc] = kinds["PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in api["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert {r["metadata"]["name"] for r in kinds["ClusterRole"]} == {
        "fp8rl-operator",
        "fp8rl-operator-discovery",
    }
    # it runs the jobs' drivers itself: the worker image (the control-plane image has no workers)
    [api_container] = api["spec"]["template"]["spec"]["containers"]
    assert api_container["image"].startswith("ghcr.io/fp8rl/worker:")
    assert api_container["command"] == ["fp8rl"] and api_container["args"] == ["serve"]
    kube = named(render(), "Deployment", "fp8rl-api")["spec"]["template"]["spec"]["containers"][0]
    assert kube["image"].startswith("ghcr.io/fp8rl/controlplane:")


def test_pods_are_non_root_read_only_without_escalation() -> None:
    for deployment in by_kind(render("--values", str(GPU_VALUES)))["Deployment"]:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and sc["privileged"] is False
            assert c["resources"]["requests"] and c["resources"]["limits"]
            assert not c["image"].endswith(":latest") and ":" in c["image"]
            assert {"mountPath": "/tmp", "name": "tmp"} in c["volumeMounts"]  # writable scratch


def rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_rbac_follows_the_values() -> None:
    """What the roles hold is derived from the calls the code makes, recorded on a real API server
    (tests/kube/test_rbac.py: the installed chart grants exactly what the audit log saw). Here, what
    the values switch: Secrets only for jobDefaults.rayAuth=secret (created, never read),
    NetworkPolicies only with networkPolicy.enabled, cluster-wide reads only, no wildcard."""
    objects = render()
    operator = rules(named(objects, "ClusterRole", "fp8rl-operator"))
    assert not any(r[1] == "secrets" for r in operator)
    secret = rules(
        named(render(values={"jobDefaults": {"rayAuth": "secret"}}), "ClusterRole", "fp8rl-operator")
    )
    assert secret - operator == {("", "secrets", "create")}
    bare = render(values={"networkPolicy": {"enabled": False}})
    assert not any(r[1] == "networkpolicies" for r in rules(named(bare, "ClusterRole", "fp8rl-operator")))
    assert {r[1] for r in operator if r[1].startswith("networkpolicies")} == {"networkpolicies"}
    discovery = rules(named(objects, "ClusterRole", "fp8rl-operator-discovery"))
    assert {verb for _, _, verb in discovery} <= {"get", "list", "watch"}
    for role in by_kind(objects)["ClusterRole"]:
        assert not any(
            "*" in x for rule in role["rules"] for x in rule["apiGroups"] + rule["resources"] + rule["verbs"]
        )


def test_the_pod_monitor_selects_the_head_pods_the_operator_builds() -> None:
    objects = render(*WITH_PROM)
    [monitor] = by_kind(objects)["PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["default"]}  # the tenants
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["honorLabels"] is True  # our job/namespace labels, not exported_job
    config = yaml.safe_load(named(objects, "ConfigMap", "fp8rl-operator")["data"]["config.yaml"])
    settings = OperatorSettings(**config)
    rljob = rl.manifest("j", "default", rl.RLJobSpec().job)
    rljob["metadata"]["uid"] = "u-1"
    rayjob = builders.rayjob(rl.RLJob.of(rljob), settings)
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    labels = head["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert all(e["key"] in labels for e in monitor["spec"]["selector"]["matchExpressions"])
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports[endpoint["port"]] == settings.metrics_port
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert not all(worker.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())


def test_service_monitor_and_network_policies_point_at_real_ports() -> None:
    objects = render(*WITH_PROM)
    [monitor] = by_kind(objects)["ServiceMonitor"]
    selected = [
        s
        for s in by_kind(objects)["Service"]
        if all(
            s["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items()
        )
    ]
    # the metrics Service alone, never the API's (which the Ingress routes to)
    assert [s["metadata"]["name"] for s in selected] == ["fp8rl-api-metrics"]
    [service] = selected
    assert service["spec"]["type"] == "ClusterIP"
    [port] = service["spec"]["ports"]
    assert monitor["spec"]["endpoints"][0]["port"] == port["name"] == port["targetPort"] == "metrics"
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "fp8rl-api"  # the scrape job
    # the pod's metrics port is the one the control plane serves its series on, not the API's
    api = named(objects, "Deployment", "fp8rl-api")
    container = api["spec"]["template"]["spec"]["containers"][0]
    served = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = env_of(api)
    assert served["metrics"] == int(env["FP8RL_METRICS_PORT"]) == 9401
    assert served["http"] == int(env["FP8RL_PORT"]) != served["metrics"]
    assert "controlPlane.metricsPort must differ" in render_error(
        values={"controlPlane": {"metricsPort": 8000}}
    )
    # the metrics port admits Prometheus only; the API port whoever apiFrom names
    policy = named(objects, "NetworkPolicy", "fp8rl-api")
    by_port = {p["port"]: rule.get("from") for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert by_port["metrics"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    assert by_port["http"] is None  # networkPolicy.apiFrom: [] (anyone)
    for policy in by_kind(objects)["NetworkPolicy"]:
        selector = policy["spec"]["podSelector"]["matchLabels"]
        [deployment] = [
            d
            for d in by_kind(objects)["Deployment"]
            if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
        ]
        ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} <= ports


def test_the_dashboard_config_map_carries_the_dashboard() -> None:
    dashboard = named(render(), "ConfigMap", "fp8rl-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"]["grafana_folder"] == "fp8rl"
    assert json.loads(dashboard["data"]["fp8rl.json"]) == json.loads(
        (CHART / "dashboards" / "fp8rl.json").read_text()
    )
    without = by_kind(render(values={"grafana": {"dashboards": {"enabled": False}}}))["ConfigMap"]
    assert [c["metadata"]["name"] for c in without] == ["fp8rl-operator"]  # the operator's config only


def test_the_validators_catch_mistakes() -> None:
    objects = render(*WITH_PROM)
    deployment = named(objects, "Deployment", "fp8rl-api")
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesytem"] = True  # a typo
    with pytest.raises(AssertionError, match="readOnlyRootFilesytem"):
        validate_all([deployment])
    [monitor] = by_kind(objects)["ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["interval"] = 15  # a number where a duration string goes
    with pytest.raises(AssertionError, match="interval must be string"):
        validate_all([monitor])


WRITES = {"create", "update", "patch", "delete", "deletecollection", "bind", "escalate", "impersonate", "*"}


def operator_writes_by_namespace(objects: list[dict[str, Any]]) -> dict[str, set[tuple[str, str, str]]]:
    """What the operator's ServiceAccount may write, by namespace ("*": every namespace), from
    the rendered bindings and the roles they grant."""
    roles = {r["metadata"]["name"]: r for r in objects if r["kind"] in ("ClusterRole", "Role")}
    out: dict[str, set[tuple[str, str, str]]] = {}
    for binding in [o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")]:
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == "fp8rl-operator" for s in binding["subjects"]
        ):
            continue
        granted = {r for r in rules(roles[binding["roleRef"]["name"]]) if r[2] in WRITES}
        where = binding["metadata"].get("namespace", "*") if binding["kind"] == "RoleBinding" else "*"
        out.setdefault(where, set()).update(granted)
    return {ns: writes for ns, writes in out.items() if writes}


def test_by_default_the_operator_writes_only_in_the_tenants_namespaces() -> None:
    tenants = [{"name": "team-a"}, {"name": "team-b"}]
    objects = render(values={"tenants": tenants})
    validate_all(objects)
    writes = operator_writes_by_namespace(objects)
    assert set(writes) == {"team-a", "team-b"}  # no "*": no ClusterRoleBinding with a write
    assert ("", "configmaps", "create") in writes["team-a"]
    assert ("networking.k8s.io", "networkpolicies", "create") in writes["team-a"]
    assert "fp8rl-operator" not in {b["metadata"]["name"] for b in by_kind(objects)["ClusterRoleBinding"]}
    args = named(objects, "Deployment", "fp8rl-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]
    # watchNamespaces, when given, replaces the tenants
    objects = render(values={"tenants": tenants, "operator": {"watchNamespaces": ["team-b", "batch"]}})
    assert set(operator_writes_by_namespace(objects)) == {"team-b", "batch"}


def test_a_cluster_wide_operator_is_an_explicit_choice() -> None:
    objects = render(values={"operator": {"clusterWide": True, "watchNamespaces": ["ignored"]}})
    validate_all(objects)
    assert set(operator_writes_by_namespace(objects)) == {"*"}
    assert "fp8rl-operator" not in {b["metadata"]["name"] for b in by_kind(objects).get("RoleBinding", [])}
    args = named(objects, "Deployment", "fp8rl-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--namespace") for a in args)  # `fp8rl operator` then watches all
    discovery = rules(named(objects, "ClusterRole", "fp8rl-operator-discovery"))
    assert {r for _, r, _ in discovery} == {"customresourcedefinitions"}  # all namespaces: none listed
    # neither namespaces nor cluster-wide: refused, naming both ways out
    error = render_error(values={"tenants": [], "controlPlane": {"enabled": False}})
    assert "operator.watchNamespaces: list the namespaces" in error and "operator.clusterWide: true" in error


def test_the_operator_config_carries_the_job_guards_and_the_policy_validates(tmp_path: Path) -> None:
    values = {
        "jobDefaults": {
            "allowedImages": ["registry.example/team/"],
            "rayAuth": "secret",
            "metricsPort": 9500,
        },
        "networkPolicy": {
            "jobs": {"dashboardFrom": [{"namespaceSelector": {"matchLabels": {"team": "ray"}}}]}
        },
    }
    objects = render(values=values)
    (tmp_path / "config.yaml").write_text(
        named(objects, "ConfigMap", "fp8rl-operator")["data"]["config.yaml"]
    )
    settings = OperatorSettings.load(tmp_path / "config.yaml")
    # the chart's worker image exactly as it pins it (a tag or digest), not every tag of its repository
    assert settings.image_prefixes() == [settings.image, "registry.example/team/"]
    assert settings.image.startswith("ghcr.io/fp8rl/worker:")
    assert settings.ray_auth == "secret" and settings.network_policy is True
    # the operator admits itself: its peer selects its own pod, in the release namespace
    operator_pod = named(objects, "Deployment", "fp8rl-operator")["spec"]["template"]["metadata"]["labels"]
    prometheus, itself = settings.metrics_from
    assert itself.namespace_selector.match_labels == {"kubernetes.io/metadata.name": "fp8rl-system"}
    assert itself.pod_selector.match_labels.items() <= operator_pod.items()
    assert prometheus.namespace_selector.match_labels == {"kubernetes.io/metadata.name": "monitoring"}
    [kuberay] = settings.dashboard_from
    assert kuberay.namespace_selector.match_labels == {"team": "ray"}  # the list replaced the default
    assert kuberay.pod_selector.match_labels == {}
    # the per-job policy the operator builds from this config is a valid NetworkPolicy
    rljob = rl.manifest("j", "default", rl.RLJobSpec().job)
    rljob["metadata"]["uid"] = "u-1"
    policy = builders.network_policy(rl.RLJob.of(rljob), settings)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])} == {9500, 8265}
    # no per-job policies with networkPolicy.enabled: false
    off = render(values={"networkPolicy": {"enabled": False}})
    (tmp_path / "off.yaml").write_text(named(off, "ConfigMap", "fp8rl-operator")["data"]["config.yaml"])
    assert OperatorSettings.load(tmp_path / "off.yaml").network_policy is False


def test_bad_job_guard_values_fail_naming_the_key() -> None:
    assert 'jobDefaults.rayAuth must be "kuberay"' in render_error(
        values={"jobDefaults": {"rayAuth": "none"}}
    )
    empty = {"networkPolicy": {"jobs": {"metricsFrom": [{"podSelector": {"matchLabels": {"a": "b"}}}]}}}
    assert "networkPolicy.jobs.metricsFrom: give each peer a namespaceSelector" in render_error(values=empty)
    assert "is not a namespace name" in render_error(values={"operator": {"watchNamespaces": ["Team_A"]}})


def test_a_placeholder_digest_is_refused_naming_the_key() -> None:
    """HEAD e7cfa40's GPU example pinned all-zero digests: `helm install` as the README wrote it
    deployed images that exist nowhere. A digest must be one a push printed."""
    zeros = "sha256:" + "0" * 64
    error = render_error("--values", str(GPU_VALUES), "--set", f"images.operator.digest={zeros}")
    assert "images.operator.digest is the all-zero placeholder: build and push the image" in error
    pinned = render("--values", str(GPU_VALUES), "--set", f"images.operator.digest=sha256:{'ab' * 32}")
    [operator] = [d for d in by_kind(pinned)["Deployment"] if d["metadata"]["name"] == "fp8rl-operator"]
    image = operator["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"registry.example.com/fp8rl/operator@sha256:{'ab' * 32}"
    # the example as shipped pins nothing it cannot know: its images are pulled by the tag it names
    for name in ("controlPlane", "operator", "worker"):
        assert not yaml.safe_load(GPU_VALUES.read_text())["images"][name].get("digest")


def test_the_gpu_examples_rljob_passes_team_as_policy_and_not_team_bs(tmp_path: Path) -> None:
    """examples/rljob-qwen-gpu.yaml asks for a priority class, node selectors, tolerations, a
    queue and a volume; examples/helm-values-gpu.yaml lists them for team-a alone."""
    from operators import admission

    objects = render("--values", str(GPU_VALUES))
    (tmp_path / "config.yaml").write_text(
        named(objects, "ConfigMap", "fp8rl-operator")["data"]["config.yaml"]
    )
    settings = OperatorSettings.load(tmp_path / "config.yaml")
    example = yaml.safe_load((ROOT / "examples" / "rljob-qwen-gpu.yaml").read_text())
    spec = rl.spec_of(example)
    assert admission.policy_problems(spec, settings, "team-a") == []
    refused = admission.policy_problems(spec, settings, "team-b")
    fields = sorted(p.split(":")[0] for p in refused)
    assert fields == [
        "spec.cluster.generation.nodeSelector",
        "spec.cluster.generation.tolerations.0",
        "spec.cluster.priorityClassName",
        "spec.cluster.queue",
        "spec.cluster.training.nodeSelector",
        "spec.cluster.training.tolerations.0",
        "spec.cluster.volumeClaim",
    ]


def test_a_namespace_the_chart_creates_has_a_quota() -> None:
    tenants = [
        {"name": "team-a", "createNamespace": True, "resourceQuota": {"requests.nvidia.com/gpu": "16"}},
        {"name": "team-b", "createNamespace": True},
        {"name": "team-c"},  # not created by the chart: its quota is the cluster admin's
    ]
    objects = render(values={"tenants": tenants})
    validate_all(objects)
    quotas = {q["metadata"]["namespace"]: q["spec"]["hard"] for q in by_kind(objects)["ResourceQuota"]}
    default = {"pods": "1000", "count/configmaps": "2000", "count/secrets": "2000"}
    assert quotas == {"team-a": {**default, "requests.nvidia.com/gpu": "16"}, "team-b": default}


def test_the_control_plane_writes_rljobs_only_in_the_tenants_namespaces() -> None:
    objects = render(values={"tenants": [{"name": "team-a"}, {"name": "team-b"}]})
    roles = {r["metadata"]["name"]: r for r in objects if r["kind"] in ("ClusterRole", "Role")}
    writes: dict[str, set[tuple[str, str, str]]] = {}
    for binding in [o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")]:
        if not any(s["name"] == "fp8rl-api" for s in binding["subjects"]):
            continue
        where = binding["metadata"].get("namespace", "*") if binding["kind"] == "RoleBinding" else "*"
        granted = {r for r in rules(roles[binding["roleRef"]["name"]]) if r[2] in WRITES}
        if granted:
            writes.setdefault(where, set()).update(granted)
    assert set(writes) == {"team-a", "team-b"}  # no "*": no RLJob written in another namespace
    assert ("fp8rl.io", "rljobs", "create") in writes["team-a"]
