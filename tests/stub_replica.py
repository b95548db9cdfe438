"""A stand-in vLLM replica for the proxy's tests and benchmark: an OpenAI-shaped HTTP server (real
aiohttp, its own process, so a test can kill it like a crashed replica) that answers at once, to
measure the proxy alone, its routing, broadcast and failure handling, without vLLM's own
milliseconds. Not part of the kit.

    python tests/stub_replica.py --port 9001 --name a [--host 127.0.0.1] [--token-env NAME] [--fail PATH,...]
"""

import os
import subprocess
import time
from pathlib import Path

def stub_app(name: str, token: str | None = None, fail: tuple[str, ...] = ()):
    """The stand-in's aiohttp app. Completions answer `{"replica": name, ...}` (after
    `delay_ms` from the request body, if any, or with the whole process blocked for `block_ms`; a request whose
    connection closes while it waits is
    counted in `aborted`, as vLLM aborts it), or at once the HTTP `answer_status` of the body (on the
    replica named `fail_on` only, if given);
    `"stream": true` sends `chunks` SSE events
    `chunk_delay_ms` apart; broadcast endpoints are recorded (with their Authorization header);
    `/_stub/state` reports everything, `/_stub/reset` puts it back as it started; `/_stub/fail` makes a
    path answer 500 (to test partial broadcast failure); `/_stub/garbage` makes a path answer bytes that are not HTTP, as a port
    taken over by another service (an SSH server, say) would. With a token, `/health` answers the
    proxy's challenge with the proof of it, as a replica started by `colo_kit.async_lora.lora.replica_launch`
    does (colo_kit.async_lora.replica_auth); `auth_headers` counts the requests that carried any credentials."""
    import asyncio
    import json as _json

    from aiohttp import web

    from colo_kit.async_lora.replica_auth import CHALLENGE_HEADER, PROOF_HEADER, replica_proof

    def fresh() -> dict:
        return {"name": name, "requests": 0, "calls": [], "adapters": {}, "fail": list(fail), "hang": [], "garbage": [],
                "unauthorized": 0, "health_auth_headers": 0, "auth_headers": 0, "health_polls": 0, "aborted": 0}

    state = fresh()

    @web.middleware
    async def garbage(request, handler):
        if request.path in state["garbage"]:
            # not HTTP, and the connection stays open: the proxy's HTTP parser fails on the bytes
            # themselves, not on a hang-up (which it always handled)
            request.transport.write(b"SSH-2.0-OpenSSH_9.6 not-http\r\n\r\n")
            await asyncio.sleep(3600)
        return await handler(request)

    @web.middleware
    async def auth(request, handler):
        if "Authorization" in request.headers and not request.path.startswith("/_stub"):
            state["auth_headers"] += 1
        if token and not request.path.startswith(("/health", "/_stub")) and \
                request.headers.get("Authorization") != f"Bearer {token}":
            state["unauthorized"] += 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def hang_if_told(request):
        if request.path in state["hang"]:  # accept the request and never answer
            await asyncio.sleep(3600)

    async def health(request):
        state["health_polls"] += 1
        if "Authorization" in request.headers:
            state["health_auth_headers"] += 1
        await hang_if_told(request)
        challenge = request.headers.get(CHALLENGE_HEADER)
        if token and challenge:
            host, port = request.transport.get_extra_info("sockname")[:2]
            return web.Response(text="", headers={PROOF_HEADER: replica_proof(token, host, port, challenge)})
        return web.Response(text="")

    async def world_size(request):
        return web.json_response({"world_size": 1})

    async def server_info(request):
        return web.json_response({"vllm_config": {"cache_config": {"block_size": 32}, "lora_config": {"max_loras": 3}}})

    async def models(request):
        data = [{"id": "base", "root": "base", "parent": None}]
        data += [{"id": k, "root": v, "parent": "base"} for k, v in state["adapters"].items()]
        return web.json_response({"object": "list", "data": data})

    async def complete(request):
        body = await request.json()
        state["requests"] += 1
        await hang_if_told(request)
        if body.get("answer_status") and body.get("fail_on", name) == name:
            return web.json_response({"error": f"{name} told to answer {body['answer_status']}"},
                                     status=body["answer_status"])
        if body.get("block_ms"):  # the whole process busy, accepting no connection: an overloaded replica
            time.sleep(body["block_ms"] / 1000)
        if body.get("delay_ms"):
            try:
                await asyncio.sleep(body["delay_ms"] / 1000)
            except asyncio.CancelledError:  # the connection closed (handler_cancellation): vLLM aborts the request
                state["aborted"] += 1
                raise
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(int(body.get("chunks", 3))):
                await resp.write(f"data: {_json.dumps({'replica': name, 'i': i, 't': time.time()})}\n\n".encode())
                await asyncio.sleep(body.get("chunk_delay_ms", 0) / 1000)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"replica": name, "model": body.get("model"),
                                  "choices": [{"index": 0, "text": "ok", "token_ids": [1]}]})

    async def record(request):
        body = await request.read()
        state["calls"].append({"path": request.path, "query": request.query_string, "body": body.decode(),
                               "auth": request.headers.get("Authorization")})
        await hang_if_told(request)
        if request.path in state["fail"]:
            return web.json_response({"error": f"{name} told to fail {request.path}"}, status=500)
        if request.path == "/v1/load_lora_adapter":  # vLLM's answers: 400 when loaded already
            p = _json.loads(body)
            if p["lora_name"] in state["adapters"]:
                return web.json_response({"error": f"The lora adapter '{p['lora_name']}' has already been loaded."},
                                         status=400)
            state["adapters"][p["lora_name"]] = p["lora_path"]
        elif request.path == "/v1/unload_lora_adapter":
            if state["adapters"].pop(_json.loads(body)["lora_name"], None) is None:
                return web.json_response({"error": "The lora adapter was not found."}, status=404)
        return web.json_response({"status": "ok", "replica": name})

    async def get_state(request):
        return web.json_response(state)

    async def set_fail(request):
        state["fail"] = [p for p in request.query.get("paths", "").split(",") if p]
        return web.json_response(state["fail"])

    async def set_hang(request):
        state["hang"] = [p for p in request.query.get("paths", "").split(",") if p]
        return web.json_response(state["hang"])

    async def reset(request):  # back to the state it started with, for the next test that reuses this process
        state.clear()
        state.update(fresh())
        return web.json_response(state)

    async def set_garbage(request):
        state["garbage"] = [p for p in request.query.get("paths", "").split(",") if p]
        return web.json_response(state["garbage"])

    app = web.Application(middlewares=[garbage, auth], client_max_size=64 * 2**20)  # as vLLM: no 1 MB cap
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/get_world_size", world_size)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/_stub/state", get_state)
    app.router.add_post("/_stub/fail", set_fail)
    app.router.add_post("/_stub/hang", set_hang)
    app.router.add_post("/_stub/garbage", set_garbage)
    app.router.add_post("/_stub/reset", reset)
    app.router.add_post("/{tail:.*}", record)
    return app


def _spawn_stub(port: int, name: str, token_env: str | None = None, log_path=None,
                fail: tuple[str, ...] = (), host: str = "127.0.0.1", backlog: int = 128) -> subprocess.Popen:
    import sys

    argv = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--name", name, "--host", host,
            "--backlog", str(backlog)]
    if token_env:
        argv += ["--token-env", token_env]
    if fail:
        argv += ["--fail", ",".join(fail)]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def _wait_healthy(port: int, proc: subprocess.Popen, deadline: float, host: str = "127.0.0.1") -> subprocess.Popen:
    import httpx

    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=0.5).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"stub upstream on port {port} did not start within 60 s (exit code {proc.poll()})")


def start_stub(port: int, name: str, token_env: str | None = None, log_path=None,
               fail: tuple[str, ...] = (), host: str = "127.0.0.1", backlog: int = 128) -> subprocess.Popen:
    """Start a stand-in upstream as its own process (so a test can kill it like a crashed replica).
    `fail` paths answer 500 from the first request on: set later, a health poll could come first."""
    # a deadline, not a count of tries: on 2 busy cores the interpreter and aiohttp alone took 3-10 s
    return _wait_healthy(port, _spawn_stub(port, name, token_env, log_path, fail, host, backlog), time.monotonic() + 60, host)


def start_stubs(stubs: dict[int, dict]) -> dict[int, subprocess.Popen]:
    """`start_stub(port, **kwargs)` for every `port: kwargs` at once: the processes start side by side, then each is
    waited for (a second interpreter start overlaps the first instead of following it)."""
    deadline = time.monotonic() + 60
    procs = {port: _spawn_stub(port, **kwargs) for port, kwargs in stubs.items()}
    try:
        for port, proc in procs.items():
            _wait_healthy(port, proc, deadline)
    except BaseException:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        raise
    return procs


def main(argv: list[str]) -> int:
    import argparse

    from aiohttp import web

    ap = argparse.ArgumentParser(prog="python tests/stub_replica.py")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--backlog", type=int, default=128, help="the listening socket's accept queue")
    ap.add_argument("--name", default="stub")
    ap.add_argument("--token-env", default=None)
    ap.add_argument("--fail", default="", help="comma-separated paths that answer 500 from the start")
    a = ap.parse_args(argv)
    token = os.environ.get(a.token_env) if a.token_env else None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    kwargs = {"loop": loop_factory()} if loop_factory else {}
    web.run_app(stub_app(a.name, token, tuple(p for p in a.fail.split(",") if p)), host=a.host, port=a.port, backlog=a.backlog,
                access_log=None, print=None, handler_cancellation=True, **kwargs)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
