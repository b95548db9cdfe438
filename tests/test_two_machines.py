"""Multi-node launch, run for real: two `accelerate launch` machines on one host (scripts/two_machines.py), with the
lines `colo_kit.memory.recipes.node_commands` prints; and the per-node commands and process clean-up on their own."""

import importlib.util
import os
import shlex
import sys
import time

import pytest
from conftest import load_script

from colo_kit.paths import REPO_ROOT
from colo_kit.memory.recipes import node_commands


def _script():
    return load_script("scripts/two_machines.py")


# ---------------------------------------------------------------------------------------------
# node_commands: what every node runs
# ---------------------------------------------------------------------------------------------

def test_the_72b_recipe_gives_one_line_per_node_over_the_committed_config():
    cmds = node_commands("qwen2.5-72b", 16, main_process_ip="10.0.0.1", script="train.py", script_args=["--x", "a b"])
    assert cmds["machines"] == 2 and cmds["num_processes"] == 16
    assert (REPO_ROOT / "configs/accelerate/zero3_qwen2.5-72b_16gpu.yaml").exists()  # the file the lines name
    for rank, (argv, line) in enumerate(zip(cmds["per_node"], cmds["lines"])):
        assert shlex.split(line) == argv
        assert argv[:4] == ["accelerate", "launch", "--config_file", "configs/accelerate/zero3_qwen2.5-72b_16gpu.yaml"]
        flags = dict(zip(argv[4:-3:2], argv[5:-3:2]))
        assert flags == {"--num_machines": "2", "--machine_rank": str(rank), "--main_process_ip": "10.0.0.1",
                         "--main_process_port": "29500", "--num_processes": "16"}  # the total, not per node
        assert argv[-3:] == ["train.py", "--x", "a b"]


def test_the_srun_line_lets_each_node_expand_its_rank_and_node_zero():
    srun = node_commands("qwen2.5-72b", 16)["srun"]
    argv = shlex.split(srun)
    assert argv[:6] == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "bash"] and argv[6] == "-c"
    inner = argv[7]  # one single-quoted word: nothing expands on the submitting host
    assert srun.endswith("'") and "'$SLURM_NODEID'" not in srun
    assert '--machine_rank "$SLURM_NODEID"' in inner
    assert '--main_process_ip "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in inner
    assert "--num_processes 16" in inner and "<node 0 address>" not in inner


def test_one_node_needs_no_address_and_an_uneven_split_is_refused_with_the_fix():
    one = node_commands("qwen2.5-7b", 2)
    assert one["machines"] == 1 and "--main_process_ip" not in one["per_node"][0]
    assert "configs/accelerate/zero3_qwen2.5-7b_2gpu.yaml" in one["lines"][0]
    with pytest.raises(ValueError, match=r"gpus=12 over machines of 8: .* 6 processes .* multiple of gpus_per_node \(16\)"):
        node_commands("qwen2.5-72b", 12)
    with pytest.raises(ValueError, match="gpus=0"):
        node_commands("qwen2.5-72b", 0)


# ---------------------------------------------------------------------------------------------
# The launcher's clean-up: a deadline, and every process it started ended
# ---------------------------------------------------------------------------------------------

def _gone(pids, within_s=15):
    deadline = time.monotonic() + within_s
    script = _script()
    while time.monotonic() < deadline:
        if not any(script._alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def test_a_failing_node_stops_the_other_and_a_hang_meets_the_deadline(tmp_path):
    script = _script()
    pid_file = tmp_path / "pids"
    # the survivor starts a grandchild in a session of its own, as torchrun starts its workers
    hang = ["bash", "-c", f"setsid sleep 300 & echo $! >> {pid_file}; echo $$ >> {pid_file}; sleep 300"]
    t0 = time.monotonic()
    res = script.run_nodes([hang, ["bash", "-c", "sleep 1; exit 3"]], os.environ.copy(), tmp_path / "a", timeout_s=60)
    assert res["returncodes"][1] == 3 and time.monotonic() - t0 < 20
    assert _gone([int(p) for p in pid_file.read_text().split()])
    pid_file.unlink()
    res = script.run_nodes([hang, hang], os.environ.copy(), tmp_path / "b", timeout_s=2)
    assert res["returncodes"] == ["timeout", "timeout"] and res["seconds"] < 10
    assert _gone([int(p) for p in pid_file.read_text().split()])


# ---------------------------------------------------------------------------------------------
# Two machines, for real (about 2 minutes on 2 cores once DeepSpeed's CPU ops are built)
# ---------------------------------------------------------------------------------------------

def _deepspeed_here(script) -> bool:
    return importlib.util.find_spec("deepspeed") is not None or (script.deepspeed_site() / "deepspeed").is_dir()


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    from colo_kit.env import has_cuda

    if has_cuda():
        # one CPU process per "machine": a GPU node's vLLM is its CUDA build, which has no CPU path, and both
        # machines' LOCAL_RANK 0 would put two NCCL ranks on GPU 0, which NCCL refuses. Real nodes own their GPUs.
        pytest.skip("two machines on one host run as CPU processes (gloo); a GPU node's vLLM has no CPU path: "
                    "the CPU tier runs these")
    script = _script()
    # DeepSpeed is not in the CPU tier's requirements: the test uses it where `bash scripts/two_machines.sh`
    # installed it (.cache/deepspeed-cpu), and installs nothing itself
    parts = [p for p in script.PARTS if p != "zero3" or _deepspeed_here(script)]
    work = tmp_path_factory.mktemp("two-machines")
    record = script.drive(parts, out=work / "two_machines.json", timeout_s=420, work=work)
    print("\n".join(record["summary"]), file=sys.stderr)
    return record


def _check_one_world_of_two(part: dict) -> list[dict]:
    assert part["status"] == "ok", part.get("log_tails")
    ranks = sorted(part["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["machine_rank"] for r in ranks] == [0, 1]  # one process per machine, rank = machine rank here
    assert {r["world_size"] for r in ranks} == {2} and {r["accelerate_num_processes"] for r in ranks} == {2}
    assert [r["all_reduce_sum"] for r in ranks] == [3.0, 3.0]  # the all-reduce crossed the machines
    assert len({r["pid"] for r in ranks}) == 2 and {r["master"].split(":")[0] for r in ranks} == {"127.0.0.1"}
    return ranks


def _check_grpo(ranks: list[dict], distributed_type: str, steps: int = 2) -> None:
    for r in ranks:
        assert r["trainer"]["distributed_type"] == distributed_type and r["trainer"]["num_processes"] == 2
        assert r["trainer"]["vllm_mode"] == "colocate" and r["trainer"]["mixed_precision"] == "no"
        assert len(r["rewards"]) == steps and all(isinstance(x, float) for x in r["rewards"])
        assert len(r["local_rewards"]) == steps and {x["n"] for x in r["local_rewards"]} == {4}
    # TRL logs the mean over both ranks' completions: the same on both; each rank scored its own
    assert ranks[0]["rewards"] == ranks[1]["rewards"]
    for step in range(steps):
        local = [r["local_rewards"][step]["mean"] for r in ranks]
        assert sum(local) / 2 == pytest.approx(ranks[0]["rewards"][step])


@pytest.mark.slow
def test_ddp_colocated_grpo_on_two_machines_is_one_world_of_two(two_machines):
    part = two_machines["parts"]["ddp"]
    ranks = _check_one_world_of_two(part)
    _check_grpo(ranks, "DistributedType.MULTI_CPU")
    # the lines that ran are node_commands' own, with the CPU substitutions as its arguments
    argv = shlex.split(part["commands"][0])
    config, port = argv[argv.index("--config_file") + 1], argv[argv.index("--main_process_port") + 1]
    script_at = argv.index("scripts/two_machines.py")
    again = node_commands("tiny", 2, gpus_per_node=1, config_file=config, script=argv[script_at],
                          script_args=argv[script_at + 1:], main_process_ip="127.0.0.1", main_process_port=int(port),
                          launch_args=["--mixed_precision", "no"])
    assert part["commands"] == again["lines"]
    assert "num_machines: 2" in part["config"] and "distributed_type: MULTI_GPU" in part["config"]


@pytest.mark.slow
def test_zero3_offload_colocated_grpo_on_two_machines(two_machines):
    part = two_machines["parts"].get("zero3")
    if part is None:
        pytest.skip("DeepSpeed is not installed (the CPU tier does not carry it): `bash scripts/two_machines.sh` "
                    "installs it into .cache/deepspeed-cpu; results/two_machines_cpu.json has a run")
    ranks = _check_one_world_of_two(part)
    _check_grpo(ranks, "DistributedType.DEEPSPEED")
    assert {(r["deepspeed"]["accelerator"], r["deepspeed"]["comm_backend"]) for r in ranks} == {("cpu", "gloo")}
    zero = part["deepspeed_config"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"


@pytest.mark.slow
def test_the_srun_line_itself_starts_one_world_of_two(two_machines):
    part = two_machines["parts"]["srun"]
    _check_one_world_of_two(part)
    assert part["commands"][0].startswith("srun --nodes 2 --ntasks-per-node 1 bash -c '")
    assert sorted(r["slurm_nodeid"] for r in part["ranks"]) == ["0", "1"]


@pytest.mark.slow
def test_accelerate_launch_cpu_on_two_machines_makes_two_worlds_of_one(two_machines):
    """The pitfall the DDP lines avoid: `--cpu` sends each machine to accelerate's single-process launcher
    (no torchrun, no RANK/WORLD_SIZE): each launcher does start its process, but each is rank 0 of its own world."""
    part = two_machines["parts"]["cpu_flag"]
    assert part["status"] == "ok" and len(part["ranks"]) == 2
    assert [(r["rank"], r["world_size"], r["all_reduce_sum"]) for r in part["ranks"]] == [(0, 1, 1.0), (0, 1, 1.0)]
    assert len({r["pid"] for r in part["ranks"]}) == 2


def test_a_rank_that_failed_before_joining_its_world_is_summarised_with_its_error():
    """A rank record written from the failure path has no world: the summary names the exit codes and the error
    instead of stopping the whole drive on a missing key (seen on a GPU node: `KeyError: 'world_size'`)."""
    script = _script()
    failed = {"part": "ddp", "status": "error", "returncodes": [1, 1],
              "ranks": [{"rank": 0, "status": "error", "error": "RuntimeError: NCCL error: invalid usage"}]}
    ok = {"part": "srun", "status": "ok", "returncodes": [0, 0], "seconds": 3.0,
          "ranks": [{"rank": r, "world_size": 2, "machine_rank": r, "all_reduce_sum": 3.0} for r in (0, 1)]}
    lines = script.summary({"ddp": failed, "srun": ok})
    assert lines[0].startswith("ddp: error, exit codes [1, 1]") and "NCCL error: invalid usage" in lines[0], lines
    assert lines[1].startswith("srun: 2 process(es), world size [2], machine ranks [0, 1]"), lines
