"""What a prober found on the proxy over loopback, each one pinned: the Bearer scheme in any case,
a replica that answers bytes that are not HTTP, one-line refusals of bad flags and bodies, replica
passwords kept out of what the proxy prints and serves, and clients that open sockets and send
nothing. Real HTTP servers on 127.0.0.1 (`tests/stub_replica.py`), as in tests/test_proxy.py."""

import base64
import json
import re
import socket
import subprocess
import sys
import time

import pytest
from stub_replica import start_stub
import test_proxy
from test_proxy import CLIENT_ENV, CLIENT_TOKEN, H, _proxy, _state

from colo_kit.launch import free_port
from colo_kit.routing import PrefixKeyer, rendezvous_order

stubs, adapters = test_proxy.stubs, test_proxy.adapters  # the same fixtures as tests/test_proxy.py


def _wait_for(check, timeout_s: float, what: str):
    """Poll `check()` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout_s} s")


# ---------------------------------------------------------------------------------------------
# (11) The Bearer scheme is case-insensitive (RFC 7235 2.1; vLLM accepts `bearer`)
# ---------------------------------------------------------------------------------------------

def test_the_bearer_scheme_is_accepted_in_any_case(stubs, monkeypatch):
    ports, _ = stubs
    monkeypatch.setenv(CLIENT_ENV, CLIENT_TOKEN)
    p = _proxy(ports, client_token_env=CLIENT_ENV)
    try:
        for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
            r = H.get(p.url + "/health", headers={"Authorization": f"{scheme} {CLIENT_TOKEN}"})
            assert r.status_code == 200, (scheme, r.text)
        for header in ("bearer wrong", f"Basic {CLIENT_TOKEN}", f"bearer{CLIENT_TOKEN}", "bearer", "",
                       f"bearer {CLIENT_TOKEN}x", f"bearer {CLIENT_TOKEN[:-1]}"):
            assert H.get(p.url + "/health", headers={"Authorization": header}).status_code == 401, header
    finally:
        p.stop_thread()


# ---------------------------------------------------------------------------------------------
# (9) A replica that answers bytes that are not HTTP fails over like a refused connection
# ---------------------------------------------------------------------------------------------

def test_a_replica_answering_garbage_fails_over_and_never_gives_a_traceback(stubs, caplog):
    ports, _ = stubs
    caplog.set_level("WARNING")
    urls = [f"http://127.0.0.1:{x}" for x in ports]
    bad = urls[0]
    H.post(f"{bad}/_stub/garbage", params={"paths": "/v1/completions"})
    keyer = PrefixKeyer(block_size=16)
    # a prompt whose rendezvous choice is the garbage replica: the first attempt must go there
    body = next(b for b in ({"model": "m", "prompt": [i] * 40} for i in range(200))
                if rendezvous_order(keyer.chain(b)[0], urls)[0] == bad)
    p = _proxy(ports)
    try:
        r = H.post(p.url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["replica"] == "r1", r.text
        snap = p.snapshot()
        assert snap["retries"] == 1 and snap["replicas"][bad]["failures"] == 1, snap
        assert "ClientResponseError" in snap["replicas"][bad]["last_error"]
    finally:
        p.stop_thread()

    only_bad = _proxy(ports[:1])  # nothing to fail over to: a 502 with one line of JSON
    try:
        for stream in (False, True):
            r = H.post(only_bad.url + "/v1/completions", json={**body, "stream": stream})
            assert r.status_code == 502, r.text
            assert len(r.text.strip().splitlines()) == 1
            error = r.json()["error"]
            assert error["type"] == "proxy_upstream_error" and "ClientResponseError" in error["message"]
            assert "\n" not in error["message"]
    finally:
        only_bad.stop_thread()
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text


# ---------------------------------------------------------------------------------------------
# (15) Bad flags: one line naming the value and the fix, exit 2; a NUL byte in lora_path: 400
# ---------------------------------------------------------------------------------------------

REPLICA = ["--replica", "http://127.0.0.1:1"]
CLI_CASES = [
    ([*REPLICA, "--log-level", "bogus"], "--log-level: 'bogus': choose one of debug, info, warning, error, critical"),
    ([*REPLICA, "--max-body-mb", "1e308"], "max_body_mb=1e+308: give at most 1024"),
    ([*REPLICA, "--max-body-mb", "nan"], "max_body_mb=nan: give a finite number above 0"),
    ([*REPLICA, "--max-body-mb", "inf"], "max_body_mb=inf: give a finite number above 0"),
    ([*REPLICA, "--max-body-mb", "-1"], "max_body_mb=-1.0: give a finite number above 0"),
    ([*REPLICA, "--port", "abc"], "--port: 'abc': give a port number in 1-65535"),
    ([*REPLICA, "--port", "70000"], "--port: '70000': give a port number in 1-65535"),
    ([*REPLICA, "--policy", "bogus"], "--policy: invalid choice: 'bogus' (choose from 'affinity', 'round_robin')"),
    ([*REPLICA, "--client-timeout-s", "0"], "client_timeout_s=0.0: give a finite number above 0"),
    (["--replica", "http://alice:hunter2@127.0.0.1:1", "--token-env", "COLO_KIT_TEST_REPLICA_KEY"],
     "replica URL 'http://alice:***@127.0.0.1:1' with --token-env COLO_KIT_TEST_REPLICA_KEY: the URL's user:password "
     "and the token would both be the Authorization header; drop one"),
    ([*REPLICA, "--adapter-root", "/"],
     "--adapter-root /: the adapter root / would let any file on the machine be loaded; give the folder that holds "
     "your adapters"),
    ([*REPLICA, "--adapter-root", "/tmp/.."], "the adapter root / would let any file on the machine be loaded"),
]


@pytest.mark.parametrize("argv, words", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_bad_proxy_flags_are_one_line_and_exit_2(argv, words, capsys, monkeypatch):
    from colo_kit.cli import main

    monkeypatch.setenv("COLO_KIT_TEST_REPLICA_KEY", "k")  # set, so only the URL's credentials are wrong
    assert main(["proxy", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("colo-kit proxy: ") and words in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out and "hunter2" not in captured.err + captured.out


def test_a_nul_byte_in_lora_path_is_a_400_with_one_line(stubs, adapters, caplog):
    ports, _ = stubs
    caplog.set_level("WARNING")
    p = _proxy(ports, adapter_root=str(adapters))
    try:
        r = H.post(p.url + "/v1/load_lora_adapter",
                   json={"lora_name": "trl-policy-v1", "lora_path": str(adapters / "trl-policy-v1") + "\x00x"})
        assert r.status_code == 400, r.text
        assert len(r.text.strip().splitlines()) == 1
        error = r.json()["error"]
        assert error["type"] == "invalid_adapter" and "NUL byte" in error["message"], error
        assert all(_state(x)["calls"] == [] for x in ports)
    finally:
        p.stop_thread()
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text


# ---------------------------------------------------------------------------------------------
# (4) A replica's password is shown nowhere; adapter loads forward the path as checked
# ---------------------------------------------------------------------------------------------

def test_a_replica_password_is_neither_printed_nor_served(tmp_path, adapters):
    password = "pw-not-for-the-logs"
    port = free_port()
    stub = start_stub(port, "plain", log_path=tmp_path / "plain.log")  # no token: the URL's credentials only
    out, err = tmp_path / "proxy.out", tmp_path / "proxy.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "colo_kit", "proxy", "--replica",
                                 f"http://alice:{password}@127.0.0.1:{port}", "--port", "0", "--block-size", "16",
                                 "--adapter-root", str(adapters), "--log-level", "info"], stdout=o, stderr=e)
    try:
        def serving():
            if proc.poll() is not None:
                pytest.fail(f"the proxy exited ({proc.returncode}): {err.read_text()}")
            return re.search(r"serving on (http://\S+)", out.read_text())

        url = _wait_for(serving, 60, "the proxy printing its address").group(1)
        shown = f"http://alice:***@127.0.0.1:{port}"
        metrics, as_json = H.get(url + "/metrics").text, H.get(url + "/metrics?format=json").text
        assert shown in metrics and shown in json.loads(as_json)["replicas"]
        # the credentials still reach the replica: only what is shown is redacted
        assert H.post(url + "/pause", params={"mode": "keep"}).status_code == 200
        sent = [c["auth"] for c in _state(port)["calls"] if c["path"] == "/pause"]
        assert sent == ["Basic " + base64.b64encode(f"alice:{password}".encode()).decode()]
        for text in (out.read_text(), err.read_text(), metrics, as_json, H.get(url + "/health").text):
            assert password not in text
        assert shown in out.read_text()  # "serving on ... -> <replicas>" names it, redacted
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        stub.kill()
        stub.wait()


def test_lora_path_is_forwarded_resolved(stubs, adapters):
    ports, _ = stubs
    (adapters / "latest").symlink_to(adapters / "trl-policy-v3", target_is_directory=True)
    p = _proxy(ports, adapter_root=str(adapters))
    try:
        for name, given, resolved in [("a", adapters / "trl-policy-v2" / ".." / "trl-policy-v1", "trl-policy-v1"),
                                      ("b", adapters / "latest", "trl-policy-v3")]:
            r = H.post(p.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(given)})
            assert r.status_code == 200, r.text
            assert all(_state(x)["adapters"][name] == str(adapters / resolved) for x in ports)
    finally:
        p.stop_thread()


# ---------------------------------------------------------------------------------------------
# (3) Sockets that send nothing, or stall mid-request, are closed after --client-timeout-s
# ---------------------------------------------------------------------------------------------

def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[float, bytes]:
    """Read `sock` until the proxy closes it: (seconds it took, what came). Fails after `timeout_s`."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    data = b""
    while time.monotonic() - t0 < timeout_s:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0, data
        if not chunk:
            return time.monotonic() - t0, data
        data += chunk
    pytest.fail(f"the proxy kept a stalled socket open for {timeout_s} s (got {data[:200]!r})")


def test_silent_and_stalled_sockets_are_closed_after_the_client_timeout(stubs):
    ports, _ = stubs
    p = _proxy(ports, client_timeout_s=1)
    host, port = p.url.removeprefix("http://").split(":")
    try:
        partial_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\": ")
        for sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", partial_body):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(sent)
                took, answer = _read_until_closed(sock, timeout_s=15)
            # 1 s for the head (or the body), plus at most 1 s draining an unread body, plus the 2 shared cores
            assert took < 6, (sent, took)
            if sent is partial_body:
                assert answer.startswith(b"HTTP/1.1 408") and b"--client-timeout-s" in answer, answer
            else:
                assert answer == b"", answer
        # the proxy still serves, and a keep-alive client within the timeout is not cut off
        assert H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [1] * 40}).status_code == 200
        assert p.snapshot()["errors"] == 0
    finally:
        p.stop_thread()
