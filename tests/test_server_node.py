"""Server mode across nodes (TRL's 72B layout): the commands `colo_kit.memory.recipes.server_node_commands` writes, read by
TRL's own parsers and run under stand-in SLURM tools; and the two-"node" form run for real on this host
(scripts/server_node.py: the vLLM server as one process group on its own port, the trainer as another)."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from conftest import load_script

from colo_kit.memory.recipes import TRL_SERVER_FIELDS, node_commands, server_node_commands


def _script():
    return load_script("scripts/server_node.py")


# ---------------------------------------------------------------------------------------------
# The generated commands
# ---------------------------------------------------------------------------------------------

def test_the_72b_layout_four_training_nodes_and_one_vllm_node():
    cmds = server_node_commands("Qwen/Qwen2.5-72B", 32, 8, vllm_server_host="10.0.0.5")
    assert cmds["nodes"] == 5
    assert cmds["server_node"]["argv"] == ["trl", "vllm-serve", "--model", "Qwen/Qwen2.5-72B",
                                           "--tensor_parallel_size", "8", "--host", "0.0.0.0", "--port", "8000"]
    assert shlex.split(cmds["server_node"]["line"]) == cmds["server_node"]["argv"]
    assert cmds["grpo_config"] == {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": "10.0.0.5",
                                   "vllm_server_port": 8000, "vllm_group_port": 51216}
    assert tuple(cmds["grpo_config"]) == TRL_SERVER_FIELDS and cmds["server_url"] == "http://10.0.0.5:8000"
    training = cmds["training_nodes"]
    assert training["machines"] == 4 and training["num_processes"] == 32  # the vLLM node is not a machine of it
    flags = cmds["grpo_config_args"]
    # node_commands' own lines (reused), the GRPOConfig fields appended as the script's flags
    assert training == node_commands("Qwen/Qwen2.5-72B", 32, 8, script="train.py", script_args=flags)
    for rank, argv in enumerate(training["per_node"]):
        assert argv[argv.index("--machine_rank") + 1] == str(rank) and argv[argv.index("--num_machines") + 1] == "4"
        assert argv[argv.index("train.py") + 1:] == flags
    assert set(cmds["why"]) >= {"server_node", "training_nodes", "slurm", "vllm_server_base_url", *TRL_SERVER_FIELDS}


def test_trls_own_parsers_read_both_sides_and_the_url_comes_from_host_and_port():
    """The server line is what `trl vllm-serve` parses (TRL 1.16's ScriptArguments, then its `vllm serve` command);
    the trainers' flags are what TrlParser(GRPOConfig) reads. vllm_server_base_url stays None, so TRL's
    VLLMGeneration builds the URL from vllm_server_host and vllm_server_port."""
    from trl import GRPOConfig, TrlParser
    from trl.scripts.vllm_serve import build_command, make_parser

    from colo_kit.env import has_cuda

    cmds = server_node_commands("Qwen/Qwen2.5-72B", 32, 8, vllm_server_host="10.0.0.5", vllm_server_port=8011,
                                vllm_group_port=51299, server_args=["--max_model_len", "4096"])
    sargs, extra = make_parser().parse_args_and_config(args=cmds["server_node"]["argv"][2:],
                                                       return_remaining_strings=True)
    assert extra == [] and (sargs.tensor_parallel_size, sargs.host, sargs.port, sargs.max_model_len) == \
        (8, "0.0.0.0", 8011, 4096)
    vllm = build_command(sargs)
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "8" and vllm[vllm.index("--host") + 1] == "0.0.0.0"
    assert '{"backend": "nccl"}' in vllm  # the server side of the NCCL weight sync the group port serves

    argv = cmds["training_nodes"]["per_node"][0]
    script_flags = argv[argv.index("train.py") + 1:]
    cfg, rest = TrlParser(GRPOConfig).parse_args_and_config(
        args=script_flags + ["--output_dir", "unused", "--use_cpu", str(not has_cuda()).lower()],
        return_remaining_strings=True)
    assert rest == []
    assert {name: getattr(cfg, name) for name in TRL_SERVER_FIELDS} == cmds["grpo_config"]
    assert cfg.vllm_server_base_url is None
    # TRL 1.16's rule, which the recipe's "why" states: base URL first, else host and port
    assert "vllm_server_base_url first" in cmds["why"]["vllm_server_base_url"]


def test_bad_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"server_tp=16 .* one node has \(8\).*Ray"):
        server_node_commands("m", 32, 16)
    with pytest.raises(ValueError, match="vllm_server_host='0.0.0.0'.*the vLLM node's address"):
        server_node_commands("m", 32, 8, vllm_server_host="0.0.0.0")
    with pytest.raises(ValueError, match="vllm_group_port=29500 is also accelerate's main_process_port"):
        server_node_commands("m", 32, 8, vllm_server_host="h", vllm_group_port=29500)
    with pytest.raises(ValueError, match="vllm_server_port=0"):
        server_node_commands("m", 32, 8, vllm_server_host="h", vllm_server_port=0)
    with pytest.raises(ValueError, match="gpus=12 over machines of 8"):  # node_commands' own check
        server_node_commands("m", 12, 8, vllm_server_host="h")
    with pytest.raises(ValueError, match="training_gpus=0"):
        server_node_commands("m", 0, 8, vllm_server_host="h")


# ---------------------------------------------------------------------------------------------
# The SLURM form, under stand-in srun/scontrol/curl/trl/accelerate (no SLURM, no GPUs here)
# ---------------------------------------------------------------------------------------------

FAKE_SRUN = """#!/usr/bin/env bash
# srun --nodes N (--ntasks K | --ntasks-per-node 1) --nodelist A,B,... CMD...: CMD once per listed host, with
# SLURM_NODEID (the host's index in the step) and SLURMD_NODENAME; SIGTERM ends the tasks, as srun does
list=
while [[ $1 == --* ]]; do
  case $1 in --nodelist) list=$2; shift 2;; --nodes|--ntasks|--ntasks-per-node) shift 2;;
    *) echo "stand-in srun: $1 unknown" >&2; exit 2;; esac
done
IFS=, read -ra hosts <<< "$list"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM  # before the tasks start: a step ended at once ends them too
for i in "${!hosts[@]}"; do SLURM_NODEID=$i SLURMD_NODENAME=${hosts[$i]} "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 2
printf 'gpu-a%s\\n' 0 1 2 3 4
"""
# each records its host and argv; the server takes a moment to come up, as a real one does, then "serves" until ended
FAKE_TRL = """#!/usr/bin/env bash
sleep 0.5; echo "$SLURMD_NODENAME $*" >> "$CALLS/trl"; exec sleep 120
"""
FAKE_ACCELERATE = """#!/usr/bin/env bash
printf '%s\\n' "$SLURMD_NODENAME" "$@" > "$CALLS/accelerate-$SLURM_NODEID"
"""
# /health answers once the server is up: here, once the stand-in server has recorded its start (a connect that
# waits up to 10 s, then refused with curl's exit code 7), so the job never trains before its server exists
FAKE_CURL = """#!/usr/bin/env bash
for _ in $(seq 100); do
  [[ -s $CALLS/trl ]] && { echo "$*" >> "$CALLS/curl"; exit 0; }
  sleep 0.1
done
exit 7
"""


def test_the_batch_script_puts_the_server_on_the_last_node_and_points_every_trainer_at_it(tmp_path):
    cmds = server_node_commands("Qwen/Qwen2.5-72B", 32, 8)
    sbatch = cmds["slurm"]["sbatch"]
    assert "#SBATCH --nodes=5" in sbatch and cmds["slurm"]["server_step"] in sbatch
    assert cmds["slurm"]["training_step"] in sbatch and "<vLLM node address>" not in cmds["slurm"]["training_step"]
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("trl", FAKE_TRL),
                       ("accelerate", FAKE_ACCELERATE), ("curl", FAKE_CURL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sh").write_text(sbatch)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls),
           "SLURM_JOB_NODELIST": "gpu-a[0-4]"}
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=60)
        # the server step was ended when training did (its stand-in would otherwise sleep on for 120 s)
        assert _session_empty(proc.pid), "the server step outlived the job"
    finally:
        try:  # whatever is left of the job (its background steps share its process group)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=10)
    assert proc.returncode == 0, out.decode()[-2000:]
    # the vLLM node: the last host, TRL's flags, listening on every interface
    (server,) = (calls / "trl").read_text().splitlines()
    assert server.split() == ["gpu-a4", "vllm-serve", "--model", "Qwen/Qwen2.5-72B", "--tensor_parallel_size", "8",
                              "--host", "0.0.0.0", "--port", "8000"]
    assert (calls / "curl").read_text().split() == ["-sf", "http://gpu-a4:8000/health"]  # waited for it
    # the four training nodes: their own rank, node 0's rendezvous, the vLLM node's address as vllm_server_host
    for rank in range(4):
        host, *argv = (calls / f"accelerate-{rank}").read_text().splitlines()
        assert host == f"gpu-a{rank}"
        flag = dict(zip(argv[1:argv.index("train.py"):2], argv[2:argv.index("train.py"):2]))
        assert flag["--machine_rank"] == str(rank) and flag["--main_process_ip"] == "gpu-a0"
        assert flag["--num_machines"] == "4" and flag["--num_processes"] == "32"
        grpo = argv[argv.index("train.py") + 1:]
        assert grpo == cmds["grpo_config_args"][:5] + ["gpu-a4"] + cmds["grpo_config_args"][6:]


def _session_empty(sid: int, within_s: float = 10) -> bool:
    """True once no process is left in session `sid` (a killed process may take a moment to go)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split():
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------------------
# Two "nodes" on this host, for real (about 2 minutes on 2 cores)
# ---------------------------------------------------------------------------------------------

def _groups_gone(pgids, within_s=20) -> bool:
    """True once no process is left in any of the process groups `pgids` (an engine core may take a moment)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = []
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                left.append(pgid)
            except ProcessLookupError:
                pass
        if not left:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_server_on_its_own_node_and_port_trains_a_separate_trainer_node(tmp_path):
    script = _script()
    t0 = time.monotonic()
    record = script.drive(out=tmp_path / "server_node.json", steps=2, timeout_s=300, work=tmp_path / "work")
    print(record.get("summary"), f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
    assert record["status"] == "ok", (record.get("error"), record.get("log_tails"))
    cmds, ran = record["commands"], record["ran"]
    rec = ran["trainer"]["record"]
    assert rec["status"] == "ok", rec.get("traceback")
    # two processes, each its own group, both gone at the end
    assert ran["server"]["pid"] != ran["trainer"]["pid"] and ran["server"]["stopped"]
    assert ran["server"]["alive_after_training"] and ran["trainer"]["returncode"] == 0
    assert _groups_gone([ran["server"]["pid"], ran["trainer"]["pid"]])
    # the server ran what the generated vllm-serve line says, on its own port
    parsed = ran["server"]["parsed_trl_vllm_serve_args"]
    assert parsed["port"] == cmds["grpo_config"]["vllm_server_port"] and parsed["tensor_parallel_size"] == 1
    cmd = ran["server"]["command"]
    assert cmd[cmd.index("--port") + 1] == str(parsed["port"]) and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    # the trainer ran the generated accelerate line, and TRL's client took host, port and group port from it
    assert ran["trainer"]["line"] == cmds["training_nodes"]["lines"][0]
    assert "--num_machines 1" in ran["trainer"]["line"]
    assert rec["grpo_config"] == {**cmds["grpo_config"], "vllm_server_base_url": None}
    client = rec["client"]
    assert client["mode"] == "server" and client["server_base_url"] is None
    assert client["base_url"] == cmds["server_url"] == f"http://127.0.0.1:{parsed['port']}"
    assert client["group_port"] == cmds["grpo_config"]["vllm_group_port"] != parsed["port"]
    assert client["communicator"] == "None"  # no NCCL group: the HTTP weight sync stands in
    assert rec["settings"]["http_weight_sync"] is True
    # GRPO steps ran against the server; weights crossed to it and it now answers as the trainer's model does
    assert len(rec["rewards"]) == 2 and all(isinstance(x, float) for x in rec["rewards"])
    assert len(rec["weight_syncs_s"]) >= 2  # one between the steps, one after the last
    assert rec["server_weights_changed"]
    # judged against the server's precision, measured before training with the same weights on both sides (the
    # checkpoint's bfloat16 on the server, on vLLM-CPU or CUDA kernels): training moved the model well past it, and
    # the synced server is back within it
    floor = rec["start_server_vs_trainer_max_abs_logprob_diff"]
    assert rec["unsynced_server_vs_trainer_max_abs_logprob_diff"] > 4 * floor
    synced = rec["server_vs_trainer_max_abs_logprob_diff"]
    assert synced <= 3 * floor + 1e-3 and synced < 0.5 * rec["unsynced_server_vs_trainer_max_abs_logprob_diff"]
