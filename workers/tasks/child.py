"""The program inside the grader sandbox: one long-lived process of the pool
(:mod:`workers.tasks.sandbox`), answering one request at a time.

It is run as a script (``python -I child.py``), importing nothing of fp8rl: what it can see is
the standard library, the interpreter's site-packages, and its own empty ``/tmp``. At start it
moves the protocol off fds 0/1 (user code that prints or reads stdin touches ``/dev/null``), and
when started as root it becomes ``nobody`` (65534) before any user code runs, so that the
process limit (RLIMIT_NPROC) holds and no capability is left.

Protocol: one JSON object a line each way. Requests (``op``):

- ``limits`` {memory_mb, nproc, fsize_mb}: the resource limits, set once before any user code;
- ``load`` {key, source}: compile a python grader's source and keep its ``grade``;
- ``grade`` {key, sample, item, cpu_s}: call it, within ``cpu_s`` seconds;
- ``math`` {input, reference, cpu_s}: math-verify's equivalence, 1.0 or 0.0;
- ``regex`` {pattern, text, ignore_case, cpu_s} and ``schema`` {schema, value, cpu_s}: a
  ``string_check`` regex and a ``json`` grader's JSON Schema, here because either can backtrack
  without end on hostile input;
- ``code`` {program, test, entry_point, score, cpu_s}: the program and its tests in a child
  process of this one (user code cannot break the pool's process), ``pass`` or ``fraction``; a
  program that crashes, exits or outlives ``cpu_s`` (CPU or wall clock) fails its tests: 0, not an
  error of the grader.

Answers: ``{"score": x}``, ``{"error": text}`` or ``{"timeout": true}`` (its time used up: a timer
here, ``cpu_s`` seconds of wall clock). Past that, the pool kills this process and starts another
(code stuck in C, which no signal interrupts).
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import re
import resource
import select
import signal
import sys
import time
import traceback
from typing import Any

NOBODY = 65534
MIB = 1024 * 1024
# a code grader's program gets this share of the request's time: the rest is this process's, to
# kill it and answer before the pool's own deadline
PROGRAM_SHARE = 0.8


class RequestTimeout(BaseException):
    """The request's time ran out (a BaseException: user code's ``except Exception`` cannot
    swallow it)."""


def _on_timeout(signum: int, frame: Any) -> None:
    raise RequestTimeout()


def _time_limit(seconds: float) -> None:
    # a wall-clock timer: a CPU-time one (ITIMER_PROF) makes every clock read of the process
    # slower (~20% on a loop that reads time.process_time), a cost on every request. Time is spent
    # as CPU or waiting, so this bounds both; code stuck in C (a regex) is the pool's to kill.
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))


def _demote() -> None:
    """Root becomes nobody, with a working directory it owns under the sandbox's /tmp."""
    work = os.environ.get("FP8RL_GRADER_WORKDIR", "/tmp/grader")
    os.makedirs(work, mode=0o700, exist_ok=True)
    if os.geteuid() == 0 and _nobody_can_read(os.path.dirname(os.__file__)):
        os.chown(work, NOBODY, NOBODY)
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    os.chdir(work)


def _nobody_can_read(path: str) -> bool:
    """Whether every directory down to ``path`` lets others pass (nobody could import from it):
    not so for an interpreter under root's home run without the sandbox's own view of it."""
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def _own_processes() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError):
                count += os.stat(f"/proc/{entry}").st_uid == uid
    return count


def _set_limits(memory_mb: int, nproc: int, fsize_mb: int) -> None:
    soft = _address_space() + memory_mb * MIB
    resource.setrlimit(resource.RLIMIT_AS, (soft, soft))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_mb * MIB, fsize_mb * MIB))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # this user's processes now, plus the allowance (as nobody: the pool's own, nothing else)
    limit = _own_processes() + nproc
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def _address_space() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 256 * MIB  # no /proc (a nested sandbox): about what the interpreter maps


def _finite(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float):
        raise TypeError(f"grade() returned {type(value).__name__}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"grade() returned {out}, not a finite number")
    return out


class _AssertCounter(ast.NodeTransformer):
    """Every ``assert cond`` in ``check`` becomes ``__fp8rl_assert(lambda: cond)``: counted, and a
    failing one does not stop the rest (``score: fraction``)."""

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        call = ast.Call(
            func=ast.Name("__fp8rl_assert", ast.Load()),
            args=[ast.Lambda(args=ast.arguments([], [], None, [], [], None, []), body=node.test)],
            keywords=[],
        )
        return ast.copy_location(ast.Expr(call), node)


def _counting(test: str) -> str:
    tree = ast.parse(test)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            _AssertCounter().visit(node)
    return ast.unparse(ast.fix_missing_locations(tree))


def _run_program(req: dict[str, Any], out_fd: int) -> None:
    """In the forked child: the program, then ``check(entry_point)``; the result to ``out_fd``."""
    counts = {"passed": 0, "total": 0}

    def record(cond: Any) -> None:
        counts["total"] += 1
        try:
            ok = bool(cond())
        except BaseException:
            ok = False
        counts["passed"] += ok

    fraction = req["score"] == "fraction"
    test = _counting(req["test"]) if fraction else req["test"]
    namespace: dict[str, Any] = {"__name__": "__graded__", "__fp8rl_assert": record}
    passed = False
    try:
        exec(compile(req["program"], "<completion>", "exec"), namespace)
        exec(compile(test, "<test>", "exec"), namespace)
        exec(compile(f"check({req['entry_point']})", "<check>", "exec"), namespace)
        passed = True
    except BaseException:
        passed = False
    if fraction:
        score = counts["passed"] / counts["total"] if counts["total"] else float(passed)
    else:
        score = float(passed)
    os.write(out_fd, json.dumps({"score": score}).encode())


def _code(req: dict[str, Any]) -> dict[str, Any]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the program's own process
        try:
            os.close(read_fd)
            signal.setitimer(signal.ITIMER_REAL, 0)
            cpu = max(1, math.ceil(req["cpu_s"] * PROGRAM_SHARE))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            for fd in _PROTOCOL_FDS:
                os.close(fd)
            _run_program(req, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + req["cpu_s"] * PROGRAM_SHARE
    while True:  # the program's own wall clock: past it, it is killed and fails
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            break
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    if not chunks:  # it crashed, exited, or ran out of time: the candidate failed its tests
        return {"score": 0.0}
    result: dict[str, Any] = json.loads(b"".join(chunks))
    return result


def _math(req: dict[str, Any]) -> dict[str, Any]:
    from math_verify import parse, verify  # imported on first use: sympy takes a second

    gold = parse(req["reference"], parsing_timeout=None) or parse(
        f"${req['reference']}$", parsing_timeout=None
    )
    answer = parse(req["input"], parsing_timeout=None)
    if not answer:
        return {"score": 0.0}
    return {"score": float(bool(verify(gold, answer, timeout_seconds=None)))}


_PROTOCOL_FDS: list[int] = []


def serve() -> None:
    signal.signal(signal.SIGALRM, _on_timeout)
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    _PROTOCOL_FDS.extend([requests.fileno(), answers.fileno()])
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _demote()
    graders: dict[str, Any] = {}
    for line in requests:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "limits":
                _set_limits(req["memory_mb"], req["nproc"], req["fsize_mb"])
                answer: dict[str, Any] = {"score": 1.0}
            elif op == "load":
                namespace: dict[str, Any] = {"__name__": "__grader__"}
                _time_limit(req.get("cpu_s", 30.0))
                exec(compile(req["source"], "<grader>", "exec"), namespace)
                if not callable(namespace.get("grade")):
                    raise NameError("the source defines no function grade(sample, item)")
                graders[req["key"]] = namespace["grade"]
                answer = {"score": 1.0}
            elif op == "grade":
                _time_limit(req["cpu_s"])
                answer = {"score": _finite(graders[req["key"]](req["sample"], req["item"]))}
            elif op == "math":
                _time_limit(req["cpu_s"])
                answer = _math(req)
            elif op == "code":
                answer = _code(req)
            elif op == "regex":
                _time_limit(req["cpu_s"])
                flags = re.IGNORECASE if req["ignore_case"] else 0
                answer = {"score": float(re.search(req["pattern"], req["text"], flags) is not None)}
            elif op == "schema":
                _time_limit(req["cpu_s"])
                import jsonschema

                valid = jsonschema.Draft202012Validator(req["schema"]).is_valid(req["value"])
                answer = {"score": float(valid)}
            else:
                answer = {"error": f"unknown op {op!r}"}
        except RequestTimeout:
            answer = {"timeout": True}
        except BaseException as err:
            if isinstance(err, SystemExit | KeyboardInterrupt):
                err = RuntimeError(f"{type(err).__name__} raised by the grader")
            frames = traceback.extract_tb(err.__traceback__)
            where = next((f"line {f.lineno}: " for f in reversed(frames) if f.filename == "<grader>"), "")
            answer = {"error": f"{where}{type(err).__name__}: {err}"[:2000]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    serve()
