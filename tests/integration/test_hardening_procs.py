"""Hardening regressions that need the node as its own process: its open
descriptors after ``Connection: close`` and HTTP/1.0 requests, and its log
file when a worker sends a value crafted to forge a log line."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.integration.procs import Proc, start_node
from tests.integration.test_node_death import free_port

pytestmark = pytest.mark.slow

# Requests of each kind sent by the descriptor test (the issue saw 200 leak).
REQUESTS_PER_KIND = 100
# Descriptors the node may legitimately open meanwhile (a pooled DB handle…).
FD_SLACK = 5


@pytest.fixture
async def node_proc(tmp_path: Path) -> AsyncIterator[tuple[Proc, str]]:
    port = free_port()
    proc = await start_node(str(tmp_path / "db.sqlite"), tmp_path / "state", tmp_path, node_id="hard", port=port)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def request_until_server_closes(port: int, raw: bytes) -> tuple[socket.socket, bool]:
    """Send ``raw``; read until the server closes (True) or 5 s pass (False).

    The socket is returned still open: if the server did not close its end,
    the node keeps holding a descriptor for it.
    """
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(raw)
    sock.settimeout(5.0)
    try:
        while sock.recv(65536):
            pass
        return sock, True
    except TimeoutError:
        return sock, False


async def test_connection_close_and_http10_requests_release_their_descriptors(node_proc: tuple[Proc, str]) -> None:
    proc, url = node_proc
    port = int(url.rsplit(":", 1)[1])
    requests = [b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"GET /healthz HTTP/1.0\r\n\r\n"]
    # Warm up (first request imports and caches), then take the baseline.
    sock, _ = await trio.to_thread.run_sync(request_until_server_closes, port, requests[0])
    sock.close()
    await trio.sleep(0.2)
    before = open_fds(proc.pid)
    held: list[socket.socket] = []
    try:
        for raw in requests:
            for _ in range(REQUESTS_PER_KIND):
                sock, closed_by_server = await trio.to_thread.run_sync(request_until_server_closes, port, raw)
                held.append(sock)
                assert closed_by_server, f"the node kept the connection open after answering {raw!r}"
        await trio.sleep(0.2)
        assert open_fds(proc.pid) <= before + FD_SLACK
    finally:
        for sock in held:
            sock.close()


async def test_a_worker_id_holding_a_newline_cannot_forge_a_log_line(node_proc: tuple[Proc, str]) -> None:
    proc, url = node_proc
    fake = "2026-11-30 12:00:00,000 ERROR ironflow.supervisor: actor: crashed, restarting actor=dispatcher"
    async with httpx.AsyncClient(base_url=url) as http:
        resp = await http.post(
            "/v1/worker/register",
            json={"type": "register", "worker_id": "w1\n" + fake + "\r\x1b[2K", "functions": []},
        )
        assert resp.status_code == 201
    with trio.fail_after(10):
        while "pull worker registered" not in proc.log_path.read_text():
            await trio.sleep(0.05)
    lines = proc.log_path.read_text().splitlines()
    assert not any(line.startswith(fake[:30]) for line in lines)
    registered = [line for line in lines if "pull worker registered" in line]
    assert len(registered) == 1 and '\\n2026-11-30 12:00:00,000 ERROR' in registered[0]
    assert "\x1b" not in proc.log_path.read_text()
