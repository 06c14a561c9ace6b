"""In-place retries: a failed driver started again on the Ray cluster it ran on, where that is safe.

A RayJob's ``backoffLimit`` retries a failed job on a new Ray cluster: every pod is deleted and
made again, every GPU worker loads the model again, minutes before the first step. Most driver
failures do not need that (kuberay#4971): the driver died on an error of its own, an actor fault
it could not recover, a network blip, and the Ray cluster under it is whole. Then the driver is
simply started again with ``--resume`` and continues from its last checkpoint, on the same pods.

The driver's command with ``--in-place-retries N`` (``rljob.run_dir.driver_argv``, what the
operator's RayJobs run) runs this: the driver as a child process,
started again up to N times, each with ``FP8RL_DRIVER_ATTEMPT`` (2, 3, ...) and
``FP8RL_DRIVER_PREVIOUS_EXIT`` (the code the last one exited with) in its environment, which its
metrics export (``fp8rl_driver_attempt``) so that the operator records the attempt as ``reused``.

When it is **not** safe, and the supervisor exits with the driver's code so that the RayJob fails
and a new cluster is the next step (``backoffLimit``):

- the failure is the job's own and would repeat: a spec or input the driver refuses (exit 2), out
  of memory (3: the same pods have the same memory), more actor faults than the job allows (4: a
  crash loop in the data plane, where fresh pods are the remedy);
- the driver was stopped (130: a suspend, an eviction): stopping is what was asked;
- the Ray cluster lost a node it had when the driver first started (a GPU worker pod gone with its
  node, or its pod restarted without the state the actors held): the pods are not the job's any more;
- the retries are spent.

The decision is a pure function (``decide``) of the exit code, the cluster's nodes and the count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rljob.run_dir import DRIVER_MODULE
from rljob.status import EXIT_OUT_OF_MEMORY, EXIT_TOO_MANY_FAULTS

ATTEMPT_ENV = "FP8RL_DRIVER_ATTEMPT"
PREVIOUS_EXIT_ENV = "FP8RL_DRIVER_PREVIOUS_EXIT"
BAD_INPUT = 2  # the driver's exit on a spec it refuses (argparse's too)
STOPPED = 130  # SIGINT/SIGTERM: a suspend or an eviction
NOT_RETRIED = {
    BAD_INPUT: "the driver refused its spec or input",
    EXIT_OUT_OF_MEMORY: "the driver ran out of memory (the same pods have the same memory)",
    EXIT_TOO_MANY_FAULTS: "more actor faults than the job allows: fresh pods are the remedy",
    STOPPED: "the driver was stopped",
}


@dataclass(frozen=True)
class Decision:
    retry: bool
    why: str


def decide(code: int, nodes_at_start: int, nodes_now: int, retried: int, limit: int) -> Decision:
    """Whether a driver that exited with ``code`` is started again on the same cluster."""
    if code == 0:
        return Decision(False, "the driver finished")
    if code in NOT_RETRIED:
        return Decision(False, NOT_RETRIED[code])
    if code < 0 and -code in (2, 15):  # killed by SIGINT/SIGTERM: stopped, as 130
        return Decision(False, NOT_RETRIED[STOPPED])
    if nodes_now < 0:
        why = "the Ray cluster does not say which nodes are alive: it cannot be trusted whole"
        return Decision(False, why)
    if nodes_now < nodes_at_start:
        return Decision(
            False,
            f"the Ray cluster lost nodes ({nodes_now} alive of {nodes_at_start}): a new cluster is needed",
        )
    if retried >= limit:
        return Decision(False, f"the {limit} in-place retries are spent")
    return Decision(True, f"the driver exited with {code} on a whole Ray cluster ({nodes_now} nodes)")


def ray_nodes_alive() -> int:
    """Alive nodes of the Ray cluster this process runs in (the RayJob's head: RAY_ADDRESS); -1
    where none can be asked: a cluster that cannot be seen whole is not retried on."""
    import logging

    import ray

    try:
        ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    except Exception:  # no Ray cluster here, or it does not answer
        return -1
    try:
        nodes: list[dict[str, object]] = ray.nodes()  # type: ignore[no-untyped-call]
        return len([node for node in nodes if node.get("Alive")])
    finally:
        ray.shutdown()


def supervise(
    driver_args: Sequence[str],
    limit: int,
    nodes: Callable[[], int] = ray_nodes_alive,
    log: Callable[[str], None] = print,
    command: Sequence[str] = (sys.executable, "-m", DRIVER_MODULE),
) -> int:
    """Run ``COMMAND DRIVER_ARGS`` (the driver's module by default) and start it again while
    ``decide`` says so; returns the exit code of the last run."""
    nodes_at_start = nodes()
    attempt, code = 1, 0
    while True:
        env = {**os.environ, ATTEMPT_ENV: str(attempt)}
        if attempt > 1:
            env[PREVIOUS_EXIT_ENV] = str(code)
        started = time.monotonic()
        code = subprocess.run([*command, *driver_args], env=env, check=False).returncode
        decision = decide(code, nodes_at_start, nodes() if code not in (0, STOPPED) else nodes_at_start,
                          attempt - 1, limit)  # fmt: skip
        log(
            f"driver attempt {attempt} exited with {code} after {time.monotonic() - started:.0f} s: "
            f"{decision.why}{'; starting it again on the same Ray cluster' if decision.retry else ''}"
        )
        if not decision.retry:
            return 130 if code < 0 and -code in (2, 15) else code
        attempt += 1
