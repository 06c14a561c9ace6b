"""Request bodies are limited while they stream (``service.middleware``): a body over the limit gets
413 whatever its framing, a body without a known token gets 401 before a byte of it is read, and
neither makes the server hold the body. The memory checks run a real ``fp8rl serve`` and send a
32 MiB chunked body over a raw socket, as an attacker would."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from service.auth import TokenAuth
from service.main import create_app
from service.middleware import BodyLimit, BodyTooLarge, TokenFirst
from service.settings import Settings
from tests.service.servers import Served, serve

TOKEN = "body-limit-token-0123456789"
TENANT = "team-a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 1 << 20  # the service's default max_body_bytes
ATTACK = 32 << 20  # bytes the attacker sends
CHUNK = 64 << 10
GROWTH = 8 << 20  # what the server's peak memory may grow by while it refuses the attack

# -- the middleware alone (pure ASGI, no server) --------------------------------------------------


def _body_messages(sizes: list[int]) -> tuple[Receive, list[int]]:
    """A ``receive`` that hands out ``http.request`` messages of ``sizes`` bytes; the list it
    returns counts the calls."""
    calls: list[int] = []

    async def receive() -> Message:
        i = len(calls)
        calls.append(i)
        if i < len(sizes):
            return {"type": "http.request", "body": b"x" * sizes[i], "more_body": i + 1 < len(sizes)}
        return {"type": "http.disconnect"}

    return receive, calls


def _scope(headers: dict[str, str], path: str = "/v1/jobs") -> Scope:
    encoded = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": "POST", "path": path, "headers": encoded, "query_string": b""}


def _call(app: Any, scope: Scope, receive: Receive) -> list[Message]:
    """Run the ASGI ``app`` on one request; the messages it sent."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _status_and_body(sent: list[Message]) -> tuple[int, dict[str, Any]]:
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return int(start["status"]), json.loads(body)


def test_a_reading_app_gets_no_byte_past_the_limit_and_the_answer_is_413() -> None:
    got: list[int] = []

    async def reader(scope: Scope, receive: Receive, send: Send) -> None:
        while True:  # reads until the body ends, as a framework's body() does
            message = await receive()
            got.append(len(message.get("body", b"")))
            if not message.get("more_body"):
                break

    receive, calls = _body_messages([400, 400, 400, 400])  # chunked: no Content-Length
    sent = _call(BodyLimit(reader, limit=1000), _scope({"transfer-encoding": "chunked"}), receive)
    status, problem = _status_and_body(sent)
    assert status == 413 and "1000 bytes" in problem["detail"] and problem["status"] == 413
    assert sent[0]["headers"] and (b"content-type", b"application/problem+json") in sent[0]["headers"]
    assert got == [400, 400]  # the third message (1200 bytes in all) was never handed on
    assert len(calls) == 3  # nor was anything read after it


def test_an_app_that_reads_again_after_the_limit_gets_the_error_again_not_more_body() -> None:
    errors = 0

    async def stubborn(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal errors
        for _ in range(5):
            try:
                await receive()
            except BodyTooLarge:
                errors += 1
        raise BodyTooLarge(10)

    receive, calls = _body_messages([2000, 10, 10])
    status, _ = _status_and_body(_call(BodyLimit(stubborn, limit=1000), _scope({}), receive))
    assert status == 413 and errors == 5 and len(calls) == 1


def test_a_content_length_over_the_limit_is_refused_before_any_read() -> None:
    async def never(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the app must not run")

    for length in ("1001", "12abc", "-1"):
        receive, calls = _body_messages([1001])
        sent = _call(BodyLimit(never, limit=1000), _scope({"content-length": length}), receive)
        assert _status_and_body(sent)[0] == 413 and calls == [], length


def test_once_the_response_started_the_error_goes_to_the_server() -> None:
    """A response under way cannot become a 413: the error reaches the server, which ends the
    connection (no route here answers before it read its body)."""

    async def streams_first(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (await receive()).get("more_body"):
            pass

    receive, _ = _body_messages([800, 800])
    with pytest.raises(BodyTooLarge):
        _call(BodyLimit(streams_first, limit=1000), _scope({}), receive)


def test_token_first_refuses_a_body_without_a_token_from_the_headers_alone() -> None:
    ran: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        ran.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = TokenFirst(app, TokenAuth({TOKEN: TENANT}))
    for headers in ({"transfer-encoding": "chunked"}, {"content-length": "10"}):
        for auth in ({}, {"authorization": "Bearer wrong-token-0123456789"}, {"authorization": TOKEN}):
            receive, calls = _body_messages([10])
            sent = _call(guard, _scope({**headers, **auth}), receive)
            status, problem = _status_and_body(sent)
            assert status == 401 and "Bearer" in problem["detail"] and calls == [], (headers, auth)
            assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert ran == []
    # a known token, no body, or a path outside /v1/: the app decides
    for scope in (
        _scope({"transfer-encoding": "chunked", "authorization": f"Bearer {TOKEN}"}),
        _scope({}),
        _scope({"content-length": "0"}),
        _scope({"content-length": "10"}, path="/healthz"),
    ):
        receive, _ = _body_messages([])
        assert (_call(guard, scope, receive))[0]["status"] == 204
    assert len(ran) == 4


# -- the app (FastAPI's own body reading) ----------------------------------------------------------


def test_a_chunked_body_over_the_limit_is_413_from_the_route_and_a_small_one_is_created(
    tmp_path: Path,
) -> None:
    api = TestClient(create_app(Settings(data_dir=tmp_path, max_body_bytes=2048), tokens={TOKEN: TENANT}))
    headers = {**AUTH, "Content-Type": "application/json"}

    def chunks(body: bytes, size: int) -> Iterator[bytes]:  # no Content-Length: sent chunked
        return (body[i : i + size] for i in range(0, len(body), size))

    big = json.dumps({"name": "big", "spec": {"task": {"params": {"x": "a" * 5000}}}}).encode()
    r = api.post("/v1/jobs", content=chunks(big, 512), headers=headers)
    assert r.status_code == 413 and "2048" in r.json()["detail"], r.text
    assert r.headers["content-type"] == "application/problem+json"
    small = json.dumps({"name": "small", "spec": {"steps": 1}}).encode()
    assert api.post("/v1/jobs", content=chunks(small, 7), headers=headers).status_code == 201
    no_token = api.post("/v1/jobs", content=chunks(big, 512), headers={"Content-Type": "application/json"})
    assert no_token.status_code == 401 and no_token.headers["www-authenticate"] == "Bearer"


# -- a real server ----------------------------------------------------------------------------------


def _memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class _Peak:
    """The process's peak RSS over a block, in KiB: the kernel's own (VmHWM, reset at the start
    through ``clear_refs``) where it lets us reset it, else VmRSS sampled every millisecond by a
    thread (which may miss a peak shorter than that; never the final RSS alone)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.kib = pid, 0
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.kernel = True
        except OSError:
            self.kernel = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.kib = max(self.kib, _memory_kib(self.pid, "VmRSS"))
            time.sleep(0.001)

    def __enter__(self) -> _Peak:
        if not self.kernel:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.kernel:
            self.kib = _memory_kib(self.pid, "VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            self.kib = max(self.kib, _memory_kib(self.pid, "VmRSS"))


def _send_chunked(url: str, headers: dict[str, str], total: int) -> tuple[int, dict[str, Any]]:
    """POST ``total`` bytes of a JSON body that never ends, chunked, over a raw socket; stop
    sending as soon as the server answers (or closes, or stops reading), then read the answer."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=10)
    try:
        head = ["POST /v1/jobs HTTP/1.1", f"Host: {where.netloc}", "Content-Type: application/json"]
        head += ["Transfer-Encoding: chunked", *(f"{k}: {v}" for k, v in headers.items())]
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        piece = b'{"name": "big", "spec": {"task": {"params": {"x": "'.ljust(CHUNK, b"a")
        framed = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sent = 0
        try:
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(framed)
                sent += len(piece)
            if sent >= total:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the server answered and closed, or stopped reading: the answer is what counts
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())
    finally:
        sock.close()


def _send_sized(url: str, length: int) -> int:
    """Headers that announce ``length`` bytes, and no body: the server answers from the headers."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        head = ["POST /v1/jobs HTTP/1.1", f"Host: {where.netloc}", "Content-Type: application/json"]
        head += [f"Content-Length: {length}", f"Authorization: Bearer {TOKEN}"]
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # 64 MiB of address space: a driver of the job posted here fails at once instead of training
    limits = {"FP8RL_TENANT_LIMITS": json.dumps({TENANT: {"max_memory_mb": 64}}), "FP8RL_DRIVER_RETRIES": "0"}
    with serve(tmp_path_factory.mktemp("body-limit"), {TOKEN: TENANT}, env=limits) as url:
        yield url


def test_a_32_mib_chunked_body_is_refused_without_growing_the_server(server: Served) -> None:
    # warm up every path the attack takes, so that what is measured is the attack alone
    assert _send_chunked(server, {}, 4 * CHUNK)[0] == 401
    assert _send_chunked(server, AUTH, 2 * LIMIT)[0] == 413
    for headers, expected in (
        ({}, 401),
        ({"Authorization": "Bearer wrong-token-0123456789"}, 401),
        (AUTH, 413),
    ):
        before = _memory_kib(server.pid, "VmRSS")
        with _Peak(server.pid) as peak:
            status, problem = _send_chunked(server, headers, ATTACK)
        grown = (peak.kib - before) * 1024
        how = "VmHWM" if peak.kernel else "VmRSS sampled"
        assert status == expected and problem["status"] == expected, (headers, problem)
        assert grown < GROWTH, f"the server grew by {grown / 2**20:.1f} MiB ({how}) refusing {headers}"


def test_a_sized_body_over_the_limit_is_413_before_it_is_sent(server: Served) -> None:
    assert _send_sized(server, ATTACK) == 413


def test_a_normal_job_post_still_works(server: Served) -> None:
    r = httpx.post(f"{server}/v1/jobs", json={"name": "normal", "spec": {"steps": 1}}, headers=AUTH)
    assert r.status_code == 201, r.text
    assert httpx.get(f"{server}/v1/jobs/normal", headers=AUTH).json()["name"] == "normal"
    assert httpx.delete(f"{server}/v1/jobs/normal", headers=AUTH, timeout=30).status_code == 204


def test_the_sampled_peak_sees_memory_that_is_freed_before_the_end() -> None:
    """Where the kernel's peak cannot be reset, the sampling thread still sees a transient 64 MiB
    (held 50 ms, then freed): the measurement is of the peak, not of the RSS at the end."""
    import os

    pid = os.getpid()
    before = _memory_kib(pid, "VmRSS")
    peak = _Peak(pid)
    peak.kernel = False  # the fallback, whatever this kernel allows
    with peak:
        block = bytearray(64 << 20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        time.sleep(0.05)
        del block
    assert (peak.kib - before) * 1024 >= 60 << 20
    assert _memory_kib(pid, "VmRSS") - before < 32 << 10  # and it was freed: the end alone shows less
