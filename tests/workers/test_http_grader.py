"""The ``http`` grader against a real HTTP server on 127.0.0.1: the row and the sample posted, the
score read back (by hand: the server scores len(output_text) / 10), the bearer token from a file,
retries after 503s, no retry after a 400, timeouts, a bad answer, and the bound on requests in
flight; and a Kubernetes Secret's token outside Kubernetes (the operator mounts it:
tests/operators/test_builders.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rljob.graders import GRADER_SECRETS_DIR
from rljob.spec import TaskSpec
from workers.tasks.grading import Graders


class Server:
    """Scores ``len(output_text) / 10``; ``/flaky`` answers 503 to a row's first two posts,
    ``/slow`` waits 2 s, ``/bad`` answers text, ``/refuse`` 400, ``/busy`` holds a post until another
    is in flight (at most 1 s), then 0.05 s more."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.headers: list[str | None] = []
        self.seen: dict[str, int] = {}
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.posts.append(body)
                    server.headers.append(self.headers.get("Authorization"))
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    key = f"{self.path}/{body['item'].get('id')}"
                    server.seen[key] = server.seen.get(key, 0) + 1
                    tries = server.seen[key]
                try:
                    if self.path == "/flaky" and tries <= 2:
                        return self._answer(503, b"busy")
                    if self.path == "/slow":
                        time.sleep(2)
                    if self.path == "/busy":  # held until a second request is in flight (or 1 s)
                        deadline = time.monotonic() + 1.0
                        while server.in_flight < 2 and time.monotonic() < deadline:
                            time.sleep(0.01)
                        time.sleep(0.05)  # long enough for a third to arrive if nothing bounded it
                    if self.path == "/bad":
                        return self._answer(200, b"not json")
                    if self.path == "/refuse":
                        return self._answer(400, b"no such task")
                    score = len(body["sample"]["output_text"]) / 10
                    self._answer(200, json.dumps({"score": score}).encode())
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _answer(self, code: int, payload: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.httpd.shutdown()


class Row:
    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry, self.answer = entry, ""


def graders(grader: dict[str, Any], base: Path | None = None) -> Graders:
    spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "grader": grader})
    return Graders(spec.grader_list(), lambda a, r: 0.0, max_error_fraction=1.0, base=base)


def test_the_row_and_sample_are_posted_and_the_score_read(server: Server, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret-token\n")
    g = graders({"type": "http", "url": f"{server.url}/score", "token_file": "token"}, tmp_path)
    grades, reports = g.grade(["abcd", '{"a": 1}', "x" * 20], [Row({"id": i}) for i in range(3)])
    # 4 / 10; 8 / 10; 20 / 10 clipped to 1
    assert [x.reward for x in grades] == [0.4, 0.8, 1.0]
    assert reports["http"].errors == reports["http"].timeouts == 0
    assert sorted(p["item"]["id"] for p in server.posts) == [0, 1, 2]
    sent = next(p for p in server.posts if p["item"]["id"] == 1)
    assert sent["sample"] == {"output_text": '{"a": 1}', "output_json": {"a": 1}}
    assert server.headers == ["Bearer s3cret-token"] * 3


def test_retries_timeouts_and_bad_answers_score_0_and_are_counted(server: Server) -> None:
    flaky = graders({"type": "http", "url": f"{server.url}/flaky", "retries": 2})
    grades, reports = flaky.grade(["ab"], [Row({"id": 7})])
    assert grades[0].reward == 0.2 and server.seen["/flaky/7"] == 3  # two 503s, then the answer
    too_few = graders({"type": "http", "url": f"{server.url}/flaky", "retries": 1})
    grades, reports = too_few.grade(["ab"], [Row({"id": 8})])
    assert grades[0].reward == 0.0 and reports["http"].first_error == f"{server.url}/flaky answered 503"
    refused = graders({"type": "http", "url": f"{server.url}/refuse", "retries": 3})
    _, reports = refused.grade(["ab"], [Row({"id": 9})])
    assert server.seen["/refuse/9"] == 1  # a 400 is not retried
    assert reports["http"].first_error == f"{server.url}/refuse answered 400: no such task"
    bad = graders({"type": "http", "url": f"{server.url}/bad", "retries": 0})
    _, reports = bad.grade(["ab"], [Row({"id": 1})])
    assert reports["http"].first_error == f"{server.url}/bad answered 'not json', not JSON"
    slow = graders({"type": "http", "url": f"{server.url}/slow", "timeout_s": 0.3, "retries": 0})
    grades, reports = slow.grade(["ab"], [Row({"id": 1})])
    assert grades[0].reward == 0.0 and reports["http"].timeouts == 1
    gone = graders({"type": "http", "url": "http://127.0.0.1:9/x", "retries": 0})
    _, reports = gone.grade(["ab"], [Row({})])
    assert "ConnectError" in (reports["http"].first_error or "")


def test_requests_in_flight_are_bounded(server: Server) -> None:
    g = graders({"type": "http", "url": f"{server.url}/busy", "max_concurrency": 2})
    grades, _ = g.grade(["a"] * 6, [Row({"id": i}) for i in range(6)])
    assert [x.reward for x in grades] == [0.1] * 6
    assert server.most_in_flight == 2


def test_a_token_secret_is_mounted_by_the_operator_and_missing_here() -> None:
    g = graders({"type": "http", "url": "http://127.0.0.1:9/x", "token_secret": {"name": "judge-token"}})
    [problem] = g.check()
    assert problem.startswith(
        "http: an http grader's token_secret judge-token/token is mounted by the operator"
    )
    assert f"{GRADER_SECRETS_DIR}/judge-token/token" in problem
