"""A real Kubernetes control plane on 127.0.0.1 for the tests: etcd, kube-apiserver (RBAC, Pod
Security admission, owner-reference permission checks, an audit log), kube-controller-manager,
kube-scheduler, kwok (nodes and pod lifecycles, no kubelet) and the KubeRay operator, all from
``tests/kube/build.py``'s cache.

``KubeCluster(workdir).start()`` brings them up (a few seconds warm) and ``stop()`` ends them;
``tests/kube/conftest.py`` holds one per test session. What is simulated, and why, is in
``tests/kube/README.md``: the pods' processes (``tests/kube/podnet.py``); everything that decides
(admission, authorization, scheduling, garbage collection, KubeRay's controllers) is the real code.

Identities: the tests act as ``fp8rl-test-admin`` (``system:masters``, a static token) unless they
ask for a ServiceAccount's token (``token_kubeconfig``), which is how the operator and the control
plane run here: with the chart's ServiceAccounts and nothing more.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.kube.build import Built

HERE = Path(__file__).resolve().parent
SERVICE_CIDR = "10.96.0.0/16"
# kwok's pod and node IPs: from the range set aside for benchmarks (RFC 2544), which no network
# routes, so nothing real answers at them; podnet.py answers for the pods
POD_CIDR = "198.18.0.0/16"
NODE_IP = "198.19.0.10"
ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN = "fp8rl-test-admin"
# the Pod Security level a tenant namespace enforces (what the chart labels its tenants with)
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}

# Audit: every request of a ServiceAccount outside kube-system (the operator, the control plane,
# tenants), at Metadata level, so that a test reads back exactly which calls each one made.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}


@dataclass(frozen=True)
class Node:
    """A simulated node: ``gpus`` of ``nvidia.com/gpu`` (0: a CPU node), labels and taints."""

    name: str
    labels: dict[str, str]
    gpus: int = 0
    cpu: str = "64"
    memory: str = "512Gi"
    taints: tuple[dict[str, str], ...] = ()


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# two GPU pools as a cloud provider labels them, and a CPU pool for the heads and the control plane
NODES = (
    Node("cpu-0", {"fp8rl.test/pool": "cpu"}, cpu="32", memory="128Gi"),
    Node("cpu-1", {"fp8rl.test/pool": "cpu"}, cpu="32", memory="128Gi"),
    Node("h100-gen-0", {"fp8rl.test/pool": "generation"}, gpus=8, taints=(GPU_TAINT,)),
    Node("h100-gen-1", {"fp8rl.test/pool": "generation"}, gpus=8, taints=(GPU_TAINT,)),
    Node("h100-train-0", {"fp8rl.test/pool": "training"}, gpus=8, taints=(GPU_TAINT,)),
)


@dataclass(frozen=True)
class AuditEvent:
    """One request the API server answered, as its audit log recorded it."""

    user: str
    verb: str
    group: str  # "" for the core group
    resource: str  # e.g. "configmaps"
    subresource: str
    namespace: str
    name: str
    code: int

    @classmethod
    def of(cls, line: dict[str, Any]) -> AuditEvent:
        ref = line.get("objectRef") or {}
        return cls(
            user=(line.get("user") or {}).get("username", ""),
            verb=line.get("verb", ""),
            group=ref.get("apiGroup", ""),
            resource=ref.get("resource", ""),
            subresource=ref.get("subresource", ""),
            namespace=ref.get("namespace", ""),
            name=ref.get("name", ""),
            code=int((line.get("responseStatus") or {}).get("code") or 0),
        )

    @property
    def rule(self) -> tuple[str, str, str]:
        """As an RBAC rule triple: (apiGroup, resource[/subresource], verb)."""
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return (self.group, resource, self.verb)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None
) -> x509.Certificate:
    """A certificate for ``subject``: a CA when ``issuer`` is None, else a serving certificate for
    127.0.0.1 and the names the in-cluster ``kubernetes`` Service answers to."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0] if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        return builder.sign(key, hashes.SHA256())
    names: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
        x509.DNSName("localhost"),
    ]
    names += [x509.DNSName(n) for n in ("kubernetes", "kubernetes.default", "kubernetes.default.svc")]
    builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer[1], hashes.SHA256())


class KubeCluster:
    """The control plane, KubeRay and simulated nodes; ``start()`` then use, ``stop()`` at the end."""

    def __init__(self, built: Built, workdir: Path, proxy: str | None = None) -> None:
        self.built, self.workdir = built, workdir
        self.proxy = proxy  # the pod network stand-in (podnet.py): where pod and Service IPs go
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.audit_log = workdir / "audit.log"
        self.ca = workdir / "ca.crt"
        self._admin_token = secrets.token_hex(16)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}

    # -- start and stop -------------------------------------------------------------------------

    def start(self) -> KubeCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_credentials()
        started = time.monotonic()
        try:
            self._start_etcd()
            self._start_apiserver()
            self._install_crds()
            self._start_controllers()
            self._create_nodes()
            self._wait_settled()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        for name in reversed(list(self._procs)):
            proc = self._procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def __enter__(self) -> KubeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, component: str, chars: int = 3000) -> str:
        path = self.workdir / f"{component}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self._logs[name] = log
        full_env = {**os.environ, **(env or {})}
        for var in ("KUBECONFIG", "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
            if var not in (env or {}):
                full_env.pop(var, None)
        self._procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def _proxied(self) -> dict[str, str]:
        """The environment that sends pod and Service addresses to the pod network stand-in; Go's
        HTTP clients honour it, and never proxy 127.0.0.1 (the API server, etcd)."""
        if not self.proxy:
            return {}
        return {"HTTP_PROXY": self.proxy, "NO_PROXY": "127.0.0.1,localhost"}

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{what} not within {timeout:.0f} s")

    # -- the parts ------------------------------------------------------------------------------

    def _write_credentials(self) -> None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _certificate("fp8rl-test-ca", ca_key, None)
        key = ec.generate_private_key(ec.SECP256R1())
        serving = _certificate("kube-apiserver", key, (ca.subject, ca_key))
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        (self.workdir / "apiserver.crt").write_bytes(serving.public_bytes(serialization.Encoding.PEM))
        (self.workdir / "apiserver.key").write_bytes(_pem_key(key))
        sa = ec.generate_private_key(ec.SECP256R1())
        (self.workdir / "sa.key").write_bytes(_pem_key(sa))
        (self.workdir / "sa.pub").write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        # static tokens: the admin, and the two components whose built-in roles bind a user name
        self._component_tokens = {
            name: secrets.token_hex(16)
            for name in ("system:kube-controller-manager", "system:kube-scheduler")
        }
        rows = [f'{self._admin_token},{ADMIN},{ADMIN},"system:masters"']
        rows += [f"{token},{name},{name}" for name, token in self._component_tokens.items()]
        (self.workdir / "tokens.csv").write_text("\n".join(rows) + "\n")
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        self.write_kubeconfig(self.kubeconfig, ADMIN, self._admin_token)
        for name, token in self._component_tokens.items():
            self.write_kubeconfig(self.workdir / f"{name.split(':')[1]}.kubeconfig", name, token)

    def write_kubeconfig(self, path: Path, user: str, token: str, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "test", "cluster": {"server": self.server, "certificate-authority": str(self.ca)}}
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {"name": "test", "context": {"cluster": "test", "user": user, "namespace": namespace}}
            ],
            "current-context": "test",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd = f"http://127.0.0.1:{client}"
        argv = [
            str(self.built.binary("kube-plane")),
            "etcd",
            "--name=default",
            f"--data-dir={self.workdir / 'etcd'}",
        ]
        argv += [f"--listen-client-urls={self.etcd}", f"--advertise-client-urls={self.etcd}"]
        argv += [
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        ]
        argv += [
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]
        self._spawn("etcd", argv)
        self._wait("etcd", lambda: httpx.get(f"{self.etcd}/health", timeout=1).json()["health"] == "true")

    def _start_apiserver(self) -> None:
        w = self.workdir
        argv = [str(self.built.binary("kube-plane")), "apiserver", f"--etcd-servers={self.etcd}"]
        argv += ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}"]
        argv += [f"--tls-cert-file={w / 'apiserver.crt'}", f"--tls-private-key-file={w / 'apiserver.key'}"]
        argv += [
            f"--client-ca-file={self.ca}",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--anonymous-auth=false",
        ]
        argv += ["--authorization-mode=RBAC", f"--service-cluster-ip-range={SERVICE_CIDR}"]
        argv += [f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}"]
        argv += [
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
        ]
        # PodSecurity is on by default; this adds the check some distributions make: setting
        # blockOwnerDeletion on an owner reference needs the right to update the owner's finalizers
        argv += ["--enable-admission-plugins=OwnerReferencesPermissionEnforcement"]
        argv += [f"--audit-policy-file={w / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}"]
        argv += ["--audit-log-format=json", "--audit-log-mode=blocking", "--allow-privileged=false"]
        # no endpoints for the `kubernetes` Service: its address would be loopback, which the API
        # server refuses to publish (nothing in a simulated pod calls it)
        argv += [
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--enable-priority-and-fairness=false",
        ]
        self._spawn("kube-apiserver", argv, self._proxied())
        self._wait("kube-apiserver", lambda: self._get("/readyz").status_code == 200, timeout=90)

    def _get(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self._admin_token}"}
        verify = ssl.create_default_context(cafile=str(self.ca))
        return httpx.get(f"{self.server}{path}", headers=headers, verify=verify, timeout=3)

    def _install_crds(self) -> None:
        # created, not applied: KubeRay's CRDs exceed the size of kubectl's last-applied annotation
        for crd in sorted(self.built.crds.glob("*.yaml")):
            self.kubectl("create", "-f", str(crd))
        # kubectl wait fails at once on a CRD the API server has not yet given any condition (a
        # busy machine): wait again until every one is Established, 60 s in all
        deadline = time.monotonic() + 60
        while True:
            left = max(1, int(deadline - time.monotonic()))
            done = self.kubectl(
                "wait", "--for=condition=Established", "crd", "--all", f"--timeout={left}s", check=False
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline or "accessor error" not in done.stderr:
                raise RuntimeError(f"the CRDs are not Established: {done.stderr.strip()}")
            time.sleep(0.5)

    def _start_controllers(self) -> None:
        w, plane = self.workdir, str(self.built.binary("kube-plane"))
        kcm = [plane, "controller-manager", f"--kubeconfig={w / 'kube-controller-manager.kubeconfig'}"]
        kcm += ["--leader-elect=false", "--use-service-account-credentials=true", "--secure-port=0"]
        kcm += [f"--service-account-private-key-file={w / 'sa.key'}", f"--root-ca-file={self.ca}"]
        self._spawn("kube-controller-manager", kcm)
        scheduler = [plane, "scheduler", f"--kubeconfig={w / 'kube-scheduler.kubeconfig'}"]
        scheduler += ["--leader-elect=false", "--secure-port=0"]
        self._spawn("kube-scheduler", scheduler)
        kwok = [str(self.built.binary("kwok")), f"--kubeconfig={self.kubeconfig}", "--manage-all-nodes=false"]
        kwok += ["--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", f"--cidr={POD_CIDR}"]
        kwok += [f"--node-ip={NODE_IP}", f"--config={HERE / 'stages.yaml'}"]
        self._spawn("kwok", kwok)
        # KubeRay as its chart runs it (one replica, no leader election), with the admin's rights
        kuberay = [
            str(self.built.binary("ray-operator")),
            "--metrics-addr=0",
            "--health-probe-bind-address=0",
        ]
        kuberay += ["--enable-leader-election=false", "--log-stdout-encoder=console"]
        self._spawn("kuberay-operator", kuberay, {"KUBECONFIG": str(self.kubeconfig), **self._proxied()})

    def _create_nodes(self) -> None:
        for node in NODES:
            self.apply(node_manifest(node))

    def _wait_settled(self) -> None:
        def nodes_ready() -> bool:
            out = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)
            ready = [
                n
                for n in out["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", [])
                )
            ]
            return len(ready) == len(NODES)

        self._wait("kwok to make the nodes Ready", nodes_ready, timeout=60)
        # the service-account controller runs: namespaces get their default ServiceAccount
        self._wait(
            "the default ServiceAccount",
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0
            ),
            timeout=60,
        )

    # -- using it -------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, kubeconfig: Path | None = None, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        from tests.helm.tools import tool

        argv = [tool("kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=120)
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        return done

    def apply(self, obj: dict[str, Any], kubeconfig: Path | None = None) -> None:
        self.kubectl("apply", "-f", "-", kubeconfig=kubeconfig, input=json.dumps(obj))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json"] + (["-n", namespace] if namespace else [])
        done = self.kubectl(*args, check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr or "not found" in done.stderr:
                return None
            raise RuntimeError(done.stderr)
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    def objects(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        args = ["get", kind, "-o", "json"] + (["-n", namespace] if namespace else ["-A"])
        if selector:
            args += ["-l", selector]
        items: list[dict[str, Any]] = json.loads(self.kubectl(*args).stdout)["items"]
        return items

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create (or relabel) a namespace; tenant namespaces pass ``RESTRICTED``."""
        self.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        )
        self._wait(
            f"the default ServiceAccount of {name}",
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        )
        return name

    def token(self, namespace: str, service_account: str, seconds: int = 7200) -> str:
        """A token of ``namespace/service_account`` (TokenRequest, as a projected volume gets one)."""
        out = self.kubectl("create", "token", service_account, "-n", namespace, f"--duration={seconds}s")
        return out.stdout.strip()

    def token_kubeconfig(self, path: Path, namespace: str, service_account: str) -> Path:
        """A kubeconfig that acts as ``namespace/service_account`` and nothing more."""
        user = f"system:serviceaccount:{namespace}:{service_account}"
        return self.write_kubeconfig(path, user, self.token(namespace, service_account), namespace)

    def audit(self, user: str | None = None) -> list[AuditEvent]:
        """The requests recorded so far (ServiceAccounts outside kube-system), of ``user`` if given."""
        events = []
        for line in self.audit_log.read_text().splitlines():
            event = AuditEvent.of(json.loads(line))
            if user is None or event.user == user:
                events.append(event)
        return events


def node_manifest(node: Node) -> dict[str, Any]:
    capacity = {"cpu": node.cpu, "memory": node.memory, "pods": "110"}
    if node.gpus:
        capacity["nvidia.com/gpu"] = str(node.gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux", **node.labels},
        },
        "spec": {"taints": [dict(t) for t in node.taints]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


@contextlib.contextmanager
def running(built: Built, workdir: Path, proxy: str | None = None) -> Iterator[KubeCluster]:
    cluster = KubeCluster(built, workdir, proxy)
    with cluster:
        yield cluster


def wait_object(
    get: Callable[[], dict[str, Any] | None],
    what: str,
    ok: Callable[[dict[str, Any]], object] = bool,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """``wait_for`` an object that exists (``get`` gives None while it does not) and is ``ok``."""
    from tests.helpers import wait_for

    found = wait_for(get, what, lambda obj: obj is not None and bool(ok(obj)), timeout)
    assert found is not None
    return found
