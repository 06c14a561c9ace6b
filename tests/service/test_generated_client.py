"""A client generated from the service's own OpenAPI document drives a real ``fp8rl serve``.

``openapi-python-client`` (a generator that knows nothing of this project) turns ``/openapi.json``
into a typed httpx package; the tests then use only that package against ``fp8rl serve --store
kubernetes`` on kmock. What this checks that the in-process API tests cannot: every status the
server answers is one the document declares for that operation (the client is built with
``raise_on_unexpected_status``), and each error body parses into the generated ``Problem`` or
``ValidationProblem`` model, i.e. the document's schemas and media types describe what is sent.

The kubernetes store is the real API server (tests/kube), reached as the chart's control plane;
it runs no drivers (the operator would, and it does not watch these tenants), so jobs here cost one
RLJob each.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.helpers import tiny_spec
from tests.kube import install
from tests.kube.cluster import KubeCluster
from tests.service import servers

TOKENS = {
    "gen-client-a-0123456789": "gen-client-a",  # the lifecycle
    "gen-client-b-0123456789": "gen-client-b",  # the errors, on a tenant of their own so counts stay exact
    "gen-client-c-0123456789": "gen-client-c",  # no namespace on the cluster: 403
}
TOKEN_A, TOKEN_B, TOKEN_C = TOKENS
# The package name the generator derives from the document's title, "fp8rl control plane"
PACKAGE = "fp8rl_control_plane_client"
# A limit well under the socket buffers: the server answers 413 without reading the body, and a
# body that fits in the buffers is sent whole before the client reads that answer
MAX_BODY_BYTES = 16 * 1024
TINY = tiny_spec(steps=3)
PROBLEM_JSON = "application/problem+json"


def serve(workdir: Path, kubeconfig: Path, ready: str) -> Any:
    """``fp8rl serve --store kubernetes`` on the test cluster with this file's tenants and body limit."""
    args = ("--store", "kubernetes", "--kubeconfig", str(kubeconfig))
    return servers.serve(
        workdir, TOKENS, *args, env={"FP8RL_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}, ready=ready
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, kube: KubeCluster, chart: Path) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("serve")
    for namespace in ("gen-client-a", "gen-client-b"):
        install.add_tenant(kube, namespace)
    kubeconfig = kube.token_kubeconfig(workdir / "api.kubeconfig", install.NAMESPACE, "fp8rl-api")
    with serve(workdir, kubeconfig, "/readyz") as url:
        yield url


def _generate(document: dict[str, Any], workdir: Path) -> Path:
    """Run the generator on ``document``; the directory holding the generated package."""
    spec = workdir / "openapi.json"
    spec.write_text(json.dumps(document))
    config = workdir / "generator.json"
    config.write_text(json.dumps({"post_hooks": []}))  # no formatter run: the code is only imported
    cmd = [sys.executable, "-m", "openapi_python_client", "generate", "--path", str(spec)]
    cmd += ["--meta", "none", "--config", str(config)]
    done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=120)
    output = f"{done.stdout}\n{done.stderr}".strip()
    assert done.returncode == 0 and "Error(s) encountered" not in output, (
        f"openapi-python-client failed (exit {done.returncode}):\n{output}"
    )
    if "Warning(s) encountered" in output:
        print(f"openapi-python-client warnings:\n{output}")
    assert (workdir / PACKAGE / "__init__.py").exists(), (
        f"expected package {PACKAGE}; generated: {sorted(p.name for p in workdir.iterdir())}"
    )
    return workdir


@pytest.fixture(scope="module")
def gen(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The generated package: ``gen.models``, ``gen.client``, and the operations by short name."""
    document = httpx.get(f"{server}/openapi.json").raise_for_status().json()
    root = str(_generate(document, tmp_path_factory.mktemp("generated")))
    sys.path.insert(0, root)
    try:

        def op(path: str) -> Any:
            return importlib.import_module(f"{PACKAGE}.api.{path}")

        yield SimpleNamespace(
            client=importlib.import_module(f"{PACKAGE}.client"),
            models=importlib.import_module(f"{PACKAGE}.models"),
            create=op("jobs.create_job_v1_jobs_post"),
            list=op("jobs.list_jobs_v1_jobs_get"),
            get=op("jobs.get_job_v1_jobs_name_get"),
            delete=op("jobs.delete_job_v1_jobs_name_delete"),
            suspend=op("jobs.suspend_job_v1_jobs_name_suspend_post"),
            resume=op("jobs.resume_job_v1_jobs_name_resume_post"),
            readyz=op("health.readyz_readyz_get"),
        )
    finally:
        sys.path.remove(root)
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def client(gen: Any, url: str, token: str) -> Any:
    # an undocumented status raises instead of parsing to None: the document must list every one
    return gen.client.AuthenticatedClient(base_url=url, token=token, raise_on_unexpected_status=True)


def job_create(gen: Any, name: str, spec: dict[str, Any] | None = None) -> Any:
    return gen.models.JobCreate.from_dict({"name": name, "spec": TINY if spec is None else spec})


def problem(gen: Any, response: Any, status: int, model: str = "Problem") -> Any:
    """The typed problem of ``response``, checked to be ``model`` with ``status`` in body and line."""
    assert response.status_code == status, (response.status_code, response.content)
    assert response.headers["content-type"] == PROBLEM_JSON
    parsed = response.parsed
    assert type(parsed) is getattr(gen.models, model), f"{status} parsed as {type(parsed)}"
    assert parsed.status == status and parsed.title and parsed.detail
    return parsed


def test_job_lifecycle_through_the_generated_client(gen: Any, server: str) -> None:
    api = client(gen, server, TOKEN_A)
    names = ["job-1", "job-2", "job-3"]  # created in name order: the listing is oldest first
    for name in names:
        r = gen.create.sync_detailed(client=api, body=job_create(gen, name))
        assert r.status_code == 201, r.content
        assert r.headers["location"] == f"/v1/jobs/{name}"
        assert type(r.parsed) is gen.models.JobPublic
        assert r.parsed.name == name and r.parsed.tenant == "gen-client-a"
        assert r.parsed.status.phase == gen.models.Phase.PENDING

    r = gen.get.sync_detailed("job-2", client=api)
    assert r.status_code == 200 and type(r.parsed) is gen.models.JobPublic
    job = r.parsed
    assert job.name == "job-2" and job.spec.steps == 3
    tiny = job.spec.model.tiny
    assert (tiny.hidden_size, tiny.intermediate_size, tiny.num_layers, tiny.num_kv_heads) == (32, 64, 1, 1)

    seen, offset = [], 0
    for _ in names:  # one page per job; a longer walk would mean next_offset never ends
        r = gen.list.sync_detailed(client=api, limit=1, offset=offset)
        assert r.status_code == 200 and type(r.parsed) is gen.models.JobList
        page = r.parsed
        assert page.total == 3 and len(page.items) == 1
        seen.append(page.items[0].name)
        if page.next_offset is None:
            break
        offset = page.next_offset
    assert seen == names and page.next_offset is None

    r = gen.suspend.sync_detailed("job-2", client=api)
    assert r.status_code == 200 and r.parsed.status.phase == gen.models.Phase.SUSPENDED
    r = gen.list.sync_detailed(client=api, phase=gen.models.Phase.SUSPENDED)
    assert [j.name for j in r.parsed.items] == ["job-2"] and r.parsed.total == 1
    r = gen.resume.sync_detailed("job-2", client=api)
    assert r.status_code == 200 and r.parsed.status.phase == gen.models.Phase.PENDING

    r = gen.delete.sync_detailed("job-3", client=api)
    assert r.status_code == 204 and r.content == b""
    problem(gen, gen.get.sync_detailed("job-3", client=api), 404)
    r = gen.list.sync_detailed(client=api)
    assert r.parsed.total == 2 and [j.name for j in r.parsed.items] == ["job-1", "job-2"]


def test_errors_parse_as_generated_problem_models(gen: Any, server: str) -> None:
    api = client(gen, server, TOKEN_B)
    assert gen.create.sync_detailed(client=api, body=job_create(gen, "only")).status_code == 201

    # 401: an unknown token, on every kind of operation
    stranger = client(gen, server, "not-a-token-0123456789")
    r = gen.list.sync_detailed(client=stranger)
    assert "bearer token" in problem(gen, r, 401).detail
    assert r.headers["www-authenticate"] == "Bearer"
    problem(gen, gen.create.sync_detailed(client=stranger, body=job_create(gen, "x")), 401)
    problem(gen, gen.suspend.sync_detailed("only", client=stranger), 401)

    # 403: the tenant's namespace does not exist on the cluster
    r = gen.create.sync_detailed(client=client(gen, server, TOKEN_C), body=job_create(gen, "x"))
    assert "gen-client-c" in problem(gen, r, 403).detail

    # 404: no such job, for each operation on /v1/jobs/{name}
    for op in (gen.get, gen.delete, gen.suspend, gen.resume):
        r = op.sync_detailed("missing", client=api)
        assert "'missing' not found" in problem(gen, r, 404).detail

    # 409: the name is taken; resume of a Pending job (Pending -> Pending is not a transition);
    # suspend of a Suspended one
    r = gen.create.sync_detailed(client=api, body=job_create(gen, "only"))
    assert "already exists" in problem(gen, r, 409).detail
    r = gen.resume.sync_detailed("only", client=api)
    assert "cannot resume a job in phase Pending" in problem(gen, r, 409).detail
    assert gen.suspend.sync_detailed("only", client=api).status_code == 200
    r = gen.suspend.sync_detailed("only", client=api)
    assert "cannot suspend a job in phase Suspended" in problem(gen, r, 409).detail

    # 422: the field is named by its path, in the body and in the query
    for body, field in [
        (job_create(gen, "Not_A_Label"), "name"),
        (job_create(gen, "bad-steps", {**TINY, "steps": 0}), "spec.steps"),
        (
            job_create(gen, "bad-model", {**TINY, "model": {"tiny": {"hidden_size": "64"}}}),
            "spec.model.tiny.hidden_size",
        ),
    ]:
        r = gen.create.sync_detailed(client=api, body=body)
        parsed = problem(gen, r, 422, "ValidationProblem")
        assert parsed.type_ == "https://fp8rl.io/problems/validation"
        assert type(parsed.errors[0]) is gen.models.FieldError and parsed.errors[0].message
        assert parsed.errors[0].field == field, parsed.errors
    r = gen.list.sync_detailed(client=api, limit=0)
    assert problem(gen, r, 422, "ValidationProblem").errors[0].field == "limit"

    # 413: a body over the server's limit (a task parameter nobody reads, padded)
    big = {**TINY, "task": {"params": {"padding": "x" * MAX_BODY_BYTES}}}
    r = gen.create.sync_detailed(client=api, body=job_create(gen, "big", big))
    assert f"over {MAX_BODY_BYTES} bytes" in problem(gen, r, 413).detail

    # nothing above created a job: the tenant still has exactly the one
    assert gen.list.sync_detailed(client=api).parsed.total == 1


def test_kubernetes_down_is_a_problem_with_retry_after(gen: Any, kube: KubeCluster, tmp_path: Path) -> None:
    from tests.kube.cluster import free_port

    kubeconfig = kube.write_kubeconfig(tmp_path / "down.kubeconfig", "nobody", "not-a-token")
    # the cluster's CA, and an address nobody listens at
    kubeconfig.write_text(kubeconfig.read_text().replace(kube.server, f"https://127.0.0.1:{free_port()}"))
    with serve(tmp_path, kubeconfig, "/healthz") as url:
        api = client(gen, url, TOKEN_A)
        for r in (gen.readyz.sync_detailed(client=api), gen.list.sync_detailed(client=api)):
            parsed = problem(gen, r, 503)
            assert parsed.type_ == "https://fp8rl.io/problems/kubernetes-unavailable"
            assert int(r.headers["retry-after"]) > 0


def test_wrong_method_is_405_with_allow(gen: Any, server: str) -> None:
    # no generated function sends a method the document does not list, so this goes through the
    # generated client's own httpx client (base URL and token set); the body is the generated Problem
    raw = client(gen, server, TOKEN_B).get_httpx_client()
    for method, path, allow in [
        ("GET", "/v1/jobs/only:suspend", "POST"),  # the custom method: POST only, not GET's route
        ("PUT", "/v1/jobs", "GET, POST"),  # two routes share the path: both methods are listed
    ]:
        r = raw.request(method, path)
        assert r.status_code == 405 and r.headers["content-type"] == PROBLEM_JSON
        assert r.headers["allow"] == allow, (method, path, r.headers.get("allow"), r.text)
        parsed = gen.models.Problem.from_dict(r.json())
        assert parsed.status == 405 and parsed.detail.endswith(f"allowed: {allow}")
