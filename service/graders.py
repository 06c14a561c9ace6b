"""Graders as the control plane sees them: whether tenants' code may be accepted, and running one
grader on one sample for ``POST /v1/graders/run`` and ``/validate``.

The control plane never grades in its own process: each call runs ``python -m
workers.tasks.one_sample`` (a process of its own, with the service's ``PATH`` and nothing else of
its environment, in an empty temporary directory). There the kinds that run user code or
unbounded matching (``python``, ``code``, ``math``, a regex, a JSON Schema:
:func:`rljob.graders.runs_in_pool`) run in the grader sandbox's pool (:mod:`workers.tasks.sandbox`),
a pool of one process started for the call and stopped after it, so no two calls (no two tenants)
ever share a process.

Where it runs:

- the worker tier installed (the embedded default, the chart's ``store: sql`` pod, which runs the
  worker image): everything, with bubblewrap where it runs; without it, the sandboxed kinds are
  refused with 422 unless ``--allow-unsandboxed-graders`` (then plain processes with the limits);
- the control-plane image (``store: kubernetes``) holds no worker tier: the schema is checked, and
  running a grader answers 501 naming ``fp8rl grade`` (the job's own pods grade its samples).

``FP8RL_GRADER_SANDBOX`` and ``FP8RL_BWRAP`` choose the sandbox as for jobs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Any

from rljob.graders import needs_sandbox, runs_in_pool, walk
from service.settings import Settings

NO_RUNTIME = (
    "this control plane has no grader runtime (the control-plane image holds no worker tier): the job's "
    "own pods grade its samples; try a grader on your machine with `fp8rl grade SPEC --item ... --sample ...`"
)


ENTRY = "workers.tasks.one_sample"  # run as a program, one per call: never imported here
CALL_TIMEOUT_S = 300.0  # a call's process: its grader's own time limits are far below this


class GraderUnavailable(RuntimeError):
    """The grader process did not answer (it crashed or overran ``CALL_TIMEOUT_S``)."""


def _pool_kinds(grader: Any) -> list[str]:
    """The kinds inside ``grader`` that need the sandbox pool."""
    return [kind for kind, g in walk(grader) if runs_in_pool(g)]


class GraderRuntime:
    """What this control plane can do with graders: whether the worker tier is installed here
    (``workers.tasks.one_sample`` can be found) and the grader sandbox runs (asked of it once, on
    first use); and a call, each in a process of its own."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._probed = False
        self.available = False  # the worker tier is installed here
        self.sandboxed = False
        self.how = ""

    def _env(self) -> dict[str, str]:
        # the grader's process gets no secret of the service: a path, a locale, the sandbox's choice
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "FP8RL_GRADER_SANDBOX")}
        return {**env, "FP8RL_BWRAP": self.settings.bwrap, "PYTHONDONTWRITEBYTECODE": "1"}

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="fp8rl-grader-call-") as cwd:
            try:
                done = subprocess.run(
                    [sys.executable, "-m", ENTRY],
                    input=json.dumps(request),
                    capture_output=True,
                    text=True,
                    timeout=CALL_TIMEOUT_S,
                    env=self._env(),
                    cwd=cwd,
                )
            except subprocess.TimeoutExpired:
                raise GraderUnavailable(
                    f"the grader's process took longer than {CALL_TIMEOUT_S:.0f} s"
                ) from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise GraderUnavailable(f"the grader's process failed ({done.returncode}): {last[:500]}")
        answer: dict[str, Any] = json.loads(done.stdout)
        return answer

    def probe(self) -> GraderRuntime:
        with self._lock:
            if self._probed:
                return self
            self._probed = True
            try:
                found_tier = importlib.util.find_spec(ENTRY.split(".")[0]) is not None
            except ImportError:  # a finder that refuses it outright
                found_tier = False
            if not found_tier:
                self.how = "no grader runtime (no worker tier)"
                return self
            self.available = True
            found = self._call({"op": "probe"})
            self.sandboxed, self.how = bool(found["sandboxed"]), str(found["how"])
            return self

    def refusal(self, graders: list[Any]) -> str | None:
        """Why a job or a run with ``graders`` (user code among them) is refused here; None: it is not.

        Only the local executor's jobs (``store: sql``) are judged: a Kubernetes job's pods bring
        their own sandbox (the worker image's bubblewrap, or the pod itself; docs/job-spec.md)."""
        names = needs_sandbox(graders)
        if not names or self.settings.allow_unsandboxed_graders:
            return None
        self.probe()
        if self.sandboxed:
            return None
        return (
            f"graders {', '.join(names)} run tenants' code, and this service has no grader sandbox "
            f"({self.how}); install bubblewrap on the service's machine, or start fp8rl serve with "
            "--allow-unsandboxed-graders (FP8RL_ALLOW_UNSANDBOXED_GRADERS) if every tenant is trusted"
        )

    def run(self, grader: Any, item: dict[str, Any], output_text: str) -> dict[str, Any]:
        """``grader`` on one sample (:func:`workers.tasks.one_sample.grade_one`) in a process of its
        own, with a pool of its own when it needs one."""
        request = {"op": "run", "grader": grader.model_dump(mode="json"), "item": item}
        return self._call({**request, "output_text": output_text, "sandbox": bool(_pool_kinds(grader))})

    def check(self, grader: Any) -> list[str]:
        """Load a python grader in a pool of its own and check JSON Schemas (:meth:`Graders.check`)."""
        request = {
            "op": "check",
            "grader": grader.model_dump(mode="json"),
            "load_code": bool(_pool_kinds(grader)),
        }
        problems: list[str] = self._call(request)["problems"]
        return problems


class RateLimit:
    """At most ``per_minute`` calls per tenant in any 60 s (a sliding window)."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._calls: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, tenant: str) -> int | None:
        """None when ``tenant`` may call now (the call is counted); else seconds to wait."""
        now = time.monotonic()
        with self._lock:
            calls = self._calls.setdefault(tenant, deque())
            while calls and calls[0] <= now - 60:
                calls.popleft()
            if len(calls) >= self.per_minute:
                return max(1, int(calls[0] + 60 - now) + 1)
            calls.append(now)
            return None
