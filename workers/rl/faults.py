"""Data-plane faults: what counts as one, how long an actor call may take, and fault drills.

A fault is an actor of the job lost or stuck: its process died (SIGKILL, OOM killer, a node
drained), its engine died (vLLM's ``EngineDeadError``, a CUDA error such as an Xid), or a call to
it did not return within its bound. :class:`workers.job.actor_group.JobActors` turns each into an
:class:`ActorFault` naming the actor and the call; the driver recovers in place
(:class:`workers.job.job_run.JobRun`): a generator fault starts fresh actors with the trainers'
current state and regenerates the step; a trainer fault starts fresh actors from the last
checkpoint. Any other
exception an actor raises (a bug, a diverged loss, a refused weight) is not a fault: retrying
would not help, so the job fails with it as before.

Hangs: a call's bound is ``max(hang_timeout_s, HANG_FACTOR x the longest of its kind's last
HANG_HISTORY durations)``; a call of a kind not seen yet (actor setup, the first generation with
its graph captures, the first training step) waits up to ``startup_timeout_s``. Both are
``resources`` fields of the job spec.

Drills (``fp8rl run --inject-fault generator:kill@10``): the driver arms one actor before the
step; the actor provokes the fault inside its next call of that step (``generate`` for a
generator, ``train_step`` for a trainer): ``kill`` (SIGKILL to its own process), ``raise`` (an
engine failure), ``hang`` (never returns), ``engine`` (vLLM: kill the engine core process, so
that vLLM itself raises ``EngineDeadError``). Each drill fires once per driver process; the
actors started after a fault are not armed again.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["generator", "trainer"]
DRILL_KINDS = ("kill", "raise", "hang", "engine")

HANG_FACTOR = 10.0  # a call may take this many times the longest recent call of its kind
HANG_HISTORY = 10  # recent durations kept per call kind

# what an engine failure looks like when an actor raises it rather than dying
_ENGINE_FAILURE_TYPES = frozenset({"EngineDeadError", "InjectedFault"})
_ENGINE_FAILURE_TEXT = re.compile(r"CUDA error|NCCL error|Xid|uncorrectable ECC|Connection closed by peer")


class ActorFault(Exception):
    """Actor ``role`` ``index`` was lost (``what``: died, engine failure, no answer) during ``call``.
    Whether the step was trained before it is the RL loop's to say
    (:class:`workers.rl.loop.StepOutcome`), not the fault's."""

    def __init__(self, role: Role, index: int, what: str, call: str) -> None:
        super().__init__(f"{role} {index} {what} during {call}")
        self.role, self.index, self.what, self.call = role, index, what, call


class RestartLimitError(RuntimeError):
    """More faults of one role than ``resources.max_<role>_restarts`` allows."""


class InjectedFault(RuntimeError):
    """The engine failure a ``raise`` drill provokes inside an actor's call."""


def is_engine_failure(err: BaseException) -> bool:
    """Whether an exception an actor raised means its engine or device is gone (a fault), rather
    than a bug or a refused input (not a fault). ``err`` may be Ray's wrapper; its cause counts."""
    seen: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in seen and len(seen) < 8:
        seen.append(e)
        if type(e).__name__ in _ENGINE_FAILURE_TYPES or _ENGINE_FAILURE_TEXT.search(str(e)):
            return True
        e = getattr(e, "cause", None) or e.__cause__
    return False


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first non-empty line of ``err``'s message, shortened: for a log line, not a traceback."""
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CallTimeouts:
    """How long each kind of actor call may take before it counts as hung (module docstring)."""

    def __init__(self, floor_s: float, startup_s: float) -> None:
        self.floor_s, self.startup_s = floor_s, startup_s
        self._recent: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=HANG_HISTORY))

    def bound(self, kind: str) -> float:
        """Seconds a call of ``kind`` may take."""
        recent = self._recent.get(kind)
        if not recent:
            return max(self.floor_s, self.startup_s)
        return max(self.floor_s, HANG_FACTOR * max(recent))

    def record(self, kind: str, seconds: float) -> None:
        """A call of ``kind`` returned after ``seconds``."""
        self._recent[kind].append(seconds)


_DRILL = re.compile(r"^(generator|trainer)(\d*):([a-z]+)@(\d+)$")


@dataclass(frozen=True)
class FaultDrill:
    """One provoked fault: actor ``role`` ``index`` does ``kind`` during step ``step``."""

    role: Role
    index: int
    kind: str
    step: int

    @classmethod
    def parse(cls, text: str) -> FaultDrill:
        """``ROLE[INDEX]:KIND@STEP``, e.g. ``generator:kill@10`` or ``trainer0:hang@3``."""
        match = _DRILL.match(text.strip())
        if match is None:
            raise ValueError(
                f"--inject-fault {text!r}: expected ROLE[INDEX]:KIND@STEP with ROLE generator or "
                f"trainer and KIND one of {', '.join(DRILL_KINDS)}, e.g. generator:kill@10"
            )
        role, index, kind, step = match.groups()
        if kind not in DRILL_KINDS:
            raise ValueError(f"--inject-fault {text!r}: KIND {kind!r} is not one of {', '.join(DRILL_KINDS)}")
        if kind == "engine" and role != "generator":
            raise ValueError(
                f"--inject-fault {text!r}: an engine drill is a generator's (vLLM's engine core)"
            )
        if int(step) < 1:
            raise ValueError(f"--inject-fault {text!r}: STEP must be an RL step, 1 or more")
        return cls(role, int(index or 0), kind, int(step))  # type: ignore[arg-type]


def provoke(kind: str, engine: Any = None) -> None:
    """Inside an actor's call: do what drill ``kind`` says (module docstring)."""
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise InjectedFault("injected engine failure (fault drill)")
    elif kind == "hang":
        threading.Event().wait()  # never set: the call never returns
    elif kind == "engine":
        kill_engine = getattr(engine, "kill_engine_core", None)
        if kill_engine is None:
            raise InjectedFault(f"injected engine failure ({type(engine).__name__}: no engine core process)")
        kill_engine()
    else:
        raise ValueError(f"unknown fault drill {kind!r}")
