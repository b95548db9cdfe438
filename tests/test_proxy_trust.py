"""Whom the proxy trusts with the replicas' token, and what it answers under load: a relay on a dead replica's address
(another host, the same port) and a replica that never proved the key are never sent the token; a replica that refuses
connections gets a 503 with Retry-After, counted. Real HTTP servers on 127.0.0.0/8 (`tests/stub_replica.py`)."""

import asyncio
import contextlib
import logging
import socket
import threading

import pytest

from stub_replica import start_stub
import test_proxy
from test_proxy import TOKEN, TOKEN_ENV, H, _proxy, _state
from test_proxy_hardening import _wait_for

from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy
from colo_kit.async_lora.replica_auth import CHALLENGE_HEADER
from colo_kit.parallel.launch import free_port

stubs, _stub_pool = test_proxy.stubs, test_proxy._stub_pool  # tests/test_proxy.py's


@contextlib.contextmanager
def _tcp_relay(host: str, port: int, to_host: str, to_port: int):
    """A process's worth of relay in a thread: every byte sent to host:port goes on to to_host:to_port and back, as a
    squatter would relay a challenge to a live replica. Yields the bytes it was sent."""
    seen = bytearray()
    loop = asyncio.new_event_loop()

    async def pipe(reader, writer, record):
        try:
            while data := await reader.read(65536):
                if record:
                    seen.extend(data)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(to_host, to_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    server = loop.run_until_complete(asyncio.start_server(handle, host, port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.close()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, server.wait_closed(), return_exceptions=True))
        loop.close()


def _stop(*procs):
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_relay_on_a_dead_replicas_host_is_never_sent_the_token(monkeypatch, tmp_path):
    """Replicas at 127.0.0.1:P and 127.0.0.2:P (one port, two hosts, as 10.0.0.5:8000 and 10.0.0.6:8000); b dies and a
    process on b's address relays everything to a: a's proof is for a's address, so the relay stays out."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    port = free_port()
    a = start_stub(port, "a", TOKEN_ENV, tmp_path / "a.log", host="127.0.0.1")
    b = start_stub(port, "b", TOKEN_ENV, tmp_path / "b.log", host="127.0.0.2")
    url_a, url_b = f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"
    p = RoutingProxy(ProxyConfig(replicas=[url_a, url_b], port=0, token_env=TOKEN_ENV, health_interval_s=0.2,
                                 block_size=16)).start_in_thread()
    try:
        assert all(r["healthy"] for r in p.snapshot()["replicas"].values())  # both proved the key for their address
        _stop(b)
        _wait_for(lambda: not p.snapshot()["replicas"][url_b]["healthy"], 15, "the killed replica leaving rotation")
        with _tcp_relay("127.0.0.2", port, "127.0.0.1", port) as seen:
            _wait_for(lambda: seen.count(CHALLENGE_HEADER.encode()) >= 3, 30, "the proxy polling the relay")
            for i in range(6):
                assert H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [i] * 40}).json()["replica"] == "a"
            assert H.get(p.url + "/v1/models").status_code == 200
            assert b"authorization" not in bytes(seen).lower(), bytes(seen)[:2000]
        snap = p.snapshot()["replicas"][url_b]
        assert not snap["healthy"] and "proof" in snap["last_error"], snap
    finally:
        p.stop_thread()
        _stop(a)


def test_a_replica_that_never_proved_the_key_is_never_sent_the_token(monkeypatch, tmp_path):
    """A process on a replica's port before the proxy starts (a re-run cell) is not asked for the block size, not
    routed to and not sent a broadcast, until a replica that holds the key answers there."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    squat, good = free_port(), free_port()
    plain = start_stub(squat, "plain", log_path=tmp_path / "plain.log")  # no key: cannot prove it
    keyed = start_stub(good, "keyed", TOKEN_ENV, tmp_path / "keyed.log")
    url = f"http://127.0.0.1:{squat}"
    p = RoutingProxy(ProxyConfig(replicas=[url, f"http://127.0.0.1:{good}"], port=0, token_env=TOKEN_ENV,
                                 health_interval_s=0.2)).start_in_thread()  # block size asked of the replicas
    try:
        assert p.config.block_size == 32  # from the keyed one
        _wait_for(lambda: _state(squat)["health_polls"] >= 3, 15, "the proxy polling it")
        for i in range(6):
            assert H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [i] * 40}).json()["replica"] == "keyed"
        assert H.post(p.url + "/reset_prefix_cache").status_code == 200
        assert H.get(p.url + "/v1/models").status_code == 200
        state = _state(squat)
        assert state["auth_headers"] == 0 and state["requests"] == 0 and state["calls"] == [], state
        snap = p.snapshot()["replicas"][url]
        assert not snap["healthy"] and "has not proved" in snap["last_error"], snap
        _stop(plain)  # the replica itself, with the key, on that port: trusted once it proves it
        plain = start_stub(squat, "r0", TOKEN_ENV, tmp_path / "again.log")
        _wait_for(lambda: p.snapshot()["replicas"][url]["healthy"], 15, "the keyed replica coming in")
    finally:
        p.stop_thread()
        _stop(plain, keyed)


async def _wait_for_in_the_callers_task(aw, timeout):
    """`asyncio.wait_for` as Python 3.12 has it: the awaitable runs in the caller's own task, not one of its own."""
    async with asyncio.timeout(timeout):
        return await aw


@pytest.mark.parametrize("wait_for", ["own task", pytest.param("caller's task", marks=pytest.mark.skipif(
    not hasattr(asyncio, "timeout"), reason="asyncio.timeout is Python 3.11's"))])
def test_a_client_closing_mid_body_is_counted_not_logged_as_a_traceback(stubs, caplog, monkeypatch, wait_for):
    """Python 3.11's `wait_for` reads the body in a task of its own, and the hang-up arrives as a ConnectionError;
    3.12's reads it in the handler's task, where aiohttp's handler cancellation wins and it arrives as a
    cancellation (seen on a GPU node's Python 3.12). Both are counted; this machine runs both."""
    if wait_for == "caller's task":
        monkeypatch.setattr(asyncio, "wait_for", _wait_for_in_the_callers_task)
    ports, _ = stubs
    p = _proxy(ports)  # no client token: any local process may do this
    host, port = p.url.removeprefix("http://").split(":")
    try:
        with caplog.at_level(logging.INFO):
            for i in range(2):
                with socket.create_connection((host, int(port))) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 1000\r\n\r\n{\"model\": ")
                    _wait_for(lambda: p.snapshot()["requests"] > i, 10, "the proxy reading the body")
            _wait_for(lambda: p.snapshot()["client_hangups"] >= 2, 10, "both hang-ups counted")
            assert H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [1] * 40}).status_code == 200
        tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
        assert not tracebacks, [r.getMessage() for r in tracebacks]
    finally:
        p.stop_thread()


def test_an_overloaded_replica_gets_503_with_retry_after_not_502(monkeypatch, tmp_path):
    """500 completions at once to one replica whose accept queue holds one connection and which blocks 100 ms per
    request: what it cannot take is shed with 503 and a Retry-After (TRL's client waits that long and retries), and
    counted; nothing is a 502."""
    import aiohttp

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    port = free_port()
    stub = start_stub(port, "busy", TOKEN_ENV, tmp_path / "busy.log", backlog=1)
    p = RoutingProxy(ProxyConfig(replicas=[f"http://127.0.0.1:{port}"], port=0, token_env=TOKEN_ENV, block_size=16,
                                 connect_timeout_s=0.5, health_interval_s=60)).start_in_thread()

    async def flood():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as s:
            async def one(i):
                body = {"model": "m", "prompt": [i] * 40, "block_ms": 100}
                async with s.post(p.url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.text()

            return await asyncio.gather(*(one(i) for i in range(500)))

    try:
        answers = asyncio.run(flood())
        statuses = [status for status, _, _ in answers]
        shed = [(after, text) for status, after, text in answers if status == 503]
        assert set(statuses) <= {200, 503} and shed and 200 in statuses, sorted(set(statuses))
        assert all(after and int(after) >= 1 and "retry after" in text for after, text in shed), shed[:3]
        assert p.snapshot()["shed"] == len(shed) and p.snapshot()["errors"] == 0
        assert f"colo_proxy_shed_total {len(shed)}.0" in H.get(p.url + "/metrics").text
    finally:
        p.stop_thread()
        _stop(stub)
