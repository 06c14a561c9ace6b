"""Build the test suite's Kubernetes once per machine, into a cache keyed by version.

What is built, each from its Go module at a pinned version (nothing is downloaded but modules from
the Go module proxy):

- ``kube-plane`` (``tests/kube/cluster``): kube-apiserver, kube-controller-manager, kube-scheduler
  and etcd in one binary, from ``k8s.io/kubernetes`` and ``go.etcd.io/etcd/server/v3`` as that
  directory's go.mod pins them. The version the binaries report is stamped in at link time.
- ``kwok`` (``sigs.k8s.io/kwok``): nodes and pod lifecycles without a kubelet.
- ``ray-operator`` (``github.com/ray-project/kuberay/ray-operator``): the KubeRay operator, and its
  CRDs copied from the same module.

The cache is ``$FP8RL_KUBE_CACHE`` or ``~/.cache/fp8rl/kube``, one directory per key: a hash of the
pins, our Go sources and the Go version. A directory is used only once its ``ready`` file exists,
so an interrupted build starts again; a lock keeps two builds of one key from racing. Go's own
module and build caches make a rebuild after a pin change cost only what changed.

``python -m tests.kube.build`` builds (or finds) it and prints the directory; ``make kube`` runs
that. A cold build took 10 min 19 s on 2 cores (2026-11-28: empty module and build caches, 1.2 GB
of modules downloaded); a warm start costs nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "cluster"  # go.mod, go.sum, main.go of kube-plane

KUBERNETES = "v1.37.2"  # must equal the k8s.io/kubernetes pin in cluster/go.mod (checked below)
KWOK = "v0.8.0"
KUBERAY = "v1.5.0"  # the newest the module proxy serves; it has no authOptions (see README.md)
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
KWOK_PACKAGE = "sigs.k8s.io/kwok/cmd/kwok"
BINARIES = ("kube-plane", "kwok", "ray-operator")


@dataclass(frozen=True)
class Built:
    """Where a build lives: ``bin/`` (the binaries) and ``crds/`` (KubeRay's CRDs)."""

    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def crds(self) -> Path:
        return self.root / "crds"

    def binary(self, name: str) -> Path:
        return self.bin / name


def cache_root() -> Path:
    return Path(os.environ.get("FP8RL_KUBE_CACHE") or Path.home() / ".cache" / "fp8rl" / "kube")


def go() -> str:
    found = shutil.which("go")
    if found is None:
        raise RuntimeError(
            "the Kubernetes tests build kube-apiserver, kwok and KubeRay from Go modules, and `go` is "
            "not on PATH: install Go 1.26 or later (the project's machines carry it)"
        )
    return found


def go_version() -> str:
    return subprocess.run(
        [go(), "env", "GOVERSION"], capture_output=True, text=True, check=True
    ).stdout.strip()


def pinned_kubernetes(go_mod: str) -> str:
    """The ``k8s.io/kubernetes`` version cluster/go.mod requires."""
    for line in go_mod.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "k8s.io/kubernetes":
            return parts[1]
        if len(parts) >= 3 and parts[:2] == ["require", "k8s.io/kubernetes"]:
            return parts[2]
    raise RuntimeError("tests/kube/cluster/go.mod does not require k8s.io/kubernetes")


def key() -> str:
    """Changes with every input of the build: our Go sources, the pins and the Go version."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((SOURCES / name).read_bytes())
    digest.update(f"{KWOK} {KUBERAY} {go_version()}".encode())
    return f"k8s-{KUBERNETES}-kuberay-{KUBERAY}-{digest.hexdigest()[:12]}"


def version_ldflags(version: str) -> str:
    """What ``hack/lib/version.sh`` stamps into a release: the binaries then say which
    Kubernetes they are (helm checks the chart's kubeVersion against it)."""
    major, minor = version.lstrip("v").split(".")[:2]
    stamped = []
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        stamped += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
            f"-X {package}.gitTreeState=clean",
        ]
    return " ".join(["-s", "-w", *stamped])


def _run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    started = time.monotonic()
    print(f"kube build: {' '.join(argv[:4])} ...", file=sys.stderr, flush=True)
    done = subprocess.run(argv, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    print(f"kube build: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def module_dir(module: str, version: str) -> Path:
    """The module's source directory in Go's module cache (downloaded if missing)."""
    out = subprocess.run(
        [go(), "mod", "download", "-json", f"{module}@{version}"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"go mod download {module}@{version} failed:\n{out.stdout}{out.stderr}")
    return Path(json.loads(out.stdout)["Dir"])


def _build_into(root: Path) -> None:
    go_mod = (SOURCES / "go.mod").read_text()
    if pinned_kubernetes(go_mod) != KUBERNETES:
        raise RuntimeError(
            f"tests/kube/cluster/go.mod pins k8s.io/kubernetes {pinned_kubernetes(go_mod)} but build.py "
            f"says {KUBERNETES}: make them equal"
        )
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    # -mod=readonly: go.sum must already hold every module; a build never edits our sources
    flags = {"GOFLAGS": "-mod=readonly -trimpath -buildvcs=false", "CGO_ENABLED": "0"}
    _run(
        [go(), "build", "-ldflags", version_ldflags(KUBERNETES), "-o", str(bin_dir / "kube-plane"), "."],
        cwd=SOURCES,
        env=flags,
    )
    installs = {**flags, "GOBIN": str(bin_dir), "GOFLAGS": "-trimpath -buildvcs=false"}
    _run([go(), "install", "-ldflags", "-s -w", f"{KWOK_PACKAGE}@{KWOK}"], cwd=root, env=installs)
    _run([go(), "install", "-ldflags", "-s -w", f"{KUBERAY_MODULE}@{KUBERAY}"], cwd=root, env=installs)
    crds = root / "crds"
    crds.mkdir()
    source = module_dir(KUBERAY_MODULE, KUBERAY) / "config" / "crd" / "bases"
    for crd in sorted(source.glob("ray.io_*.yaml")):
        shutil.copyfile(crd, crds / crd.name)
    versions = {"kubernetes": KUBERNETES, "kwok": KWOK, "kuberay": KUBERAY, "go": go_version()}
    (root / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")


def ensure() -> Built:
    """The build for the current pins: found in the cache, or made now (minutes when cold)."""
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / key()
    if (root / "ready").exists():
        return Built(root)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build of this machine finishes first
        if (root / "ready").exists():
            return Built(root)
        shutil.rmtree(root, ignore_errors=True)  # an interrupted build
        started = time.monotonic()
        _build_into(root)
        (root / "ready").write_text(f"built in {time.monotonic() - started:.0f} s\n")
    return Built(root)


if __name__ == "__main__":
    print(ensure().root)
