"""Graders as the control plane sees them: whether tenants' code may be accepted, and running one
grader on one sample for ``POST /v1/graders/run`` and ``/validate``.

The control plane never runs a grader's code in its own process. The kinds that run user code or
unbounded matching (``python``, ``code``, ``math``, a regex, a JSON Schema: ``needs_pool``) run in
the grader sandbox's pool (:mod:`workers.tasks.sandbox`): a pool of one process started for the
request and stopped after it, so no two requests (no two tenants) ever share a process. The rest
(templates, equal strings, numbers, JSON parsing, formulas) is bounded work done here.

Where it runs:

- the worker tier installed (the embedded default, the chart's ``store: sql`` pod, which runs the
  worker image): everything, with bubblewrap where it runs; without it, the sandboxed kinds are
  refused with 422 unless ``--allow-unsandboxed-graders`` (then plain processes with the limits);
- the control-plane image (``store: kubernetes``) holds no worker tier: the schema is checked, and
  running a grader answers 501 naming ``fp8rl grade`` (the job's own pods grade its samples).

``FP8RL_GRADER_SANDBOX`` and ``FP8RL_BWRAP`` choose the sandbox as for jobs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from rljob.graders import walk
from service.settings import Settings

NO_RUNTIME = (
    "this control plane has no grader runtime (the control-plane image holds no worker tier): the job's "
    "own pods grade its samples; try a grader on your machine with `fp8rl grade SPEC --item ... --sample ...`"
)


def _pool_kinds(grader: Any) -> list[str]:
    """The kinds inside ``grader`` that need the sandbox pool."""
    from workers.tasks.pool_requests import needs_pool

    return [kind for kind, g in walk(grader) if needs_pool(g)]


class GraderRuntime:
    """What this control plane can do with graders; probed once, on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._probed = False
        self.available = False  # the worker tier is importable here
        self.sandboxed = False
        self.how = ""

    def probe(self) -> GraderRuntime:
        with self._lock:
            if self._probed:
                return self
            self._probed = True
            try:
                from workers.tasks.sandbox import Launcher
            except ImportError:
                self.how = "no grader runtime (no worker tier)"
                return self
            self.available = True
            launcher = Launcher.choose(None, self.settings.bwrap)
            self.sandboxed, self.how = launcher.sandboxed, launcher.how
            self._launcher = launcher
            return self

    def refusal(self, graders: list[Any]) -> str | None:
        """Why a job or a run with ``graders`` (user code among them) is refused here; None: it is not.

        Only the local executor's jobs (``store: sql``) are judged: a Kubernetes job's pods bring
        their own sandbox (the worker image's bubblewrap, or the pod itself; docs/job-spec.md)."""
        from rljob.graders import needs_sandbox

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
        """``grader`` on one sample (:func:`workers.tasks.one_sample.grade_one`), in a pool of its own
        when it needs one."""
        from workers.tasks.one_sample import grade_one

        self.probe()
        return grade_one([grader], item, output_text, self._launcher if _pool_kinds(grader) else None)

    def check(self, grader: Any) -> list[str]:
        """Load a python grader in a pool of its own and check JSON Schemas (:meth:`Graders.check`)."""
        from workers.tasks.one_sample import check_one

        self.probe()
        return check_one([grader], self._launcher if _pool_kinds(grader) else None)


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
