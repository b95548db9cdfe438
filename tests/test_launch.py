"""colo_kit.parallel.launch: multi-process cells through torch elastic's elastic_launch, run for real —
2 forked (or spawned) CPU processes over gloo, a real Jupyter kernel, real worker crashes."""

import os
import subprocess
import sys
import textwrap

import pytest

from colo_kit.parallel.launch import KernelNotSafe, WorkerError, free_port, kernel_problems, launch
from colo_kit.paths import REPO_ROOT


def _who(tag):
    import torch
    import torch.distributed as dist

    device = f"cuda:{os.environ['LOCAL_RANK']}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([dist.get_rank() + 1.0], device=device)
    dist.all_reduce(t)
    print(f"worker {dist.get_rank()} says {tag}", flush=True)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
            "pid": os.getpid(), "sum": t.item(), "tag": tag, "port": os.environ["MASTER_PORT"]}


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad value 42 on rank one")
    return "fine"


def test_two_cpu_processes_return_results_and_each_launch_gets_its_own_port(capfd):
    first = launch(_who, "a", num_processes=2, cpu=True)
    second = launch(_who, "b", num_processes=2, cpu=True)
    for res, tag in ((first, "a"), (second, "b")):
        assert res.how == "elastic_launch (fork)" and res.backend == "gloo"
        assert [r["rank"] for r in res.results] == [0, 1]
        assert {r["world"] for r in res.results} == {2}  # really two processes, not two worlds of one
        assert {r["backend"] for r in res.results} == {"gloo"}
        assert res.results[0]["pid"] != res.results[1]["pid"] != os.getpid()
        assert [r["sum"] for r in res.results] == [3.0, 3.0]  # the all-reduce crossed processes
        assert {r["tag"] for r in res.results} == {tag}
        assert {r["port"] for r in res.results} == {str(res.port)}
    assert first.port != second.port
    out = capfd.readouterr().out
    assert "[rank 1] worker 1 says b" in out  # worker lines streamed to the caller


def test_a_worker_exception_comes_back_with_its_message_and_the_caller_survives():
    with pytest.raises(WorkerError) as info:
        launch(_fail_on_rank_one, num_processes=2, cpu=True, echo=False)
    err = info.value
    assert err.rank == 1
    assert "ValueError: bad value 42 on rank one" in str(err)
    assert "_fail_on_rank_one" in err.worker_traceback
    # The caller is alive and can launch again.
    assert launch(_who, "again", num_processes=2, cpu=True, echo=False).results[1]["tag"] == "again"


def _hang_on_rank_one():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()  # rank 0 waits in a collective: no Python signal handler runs there


def test_a_timeout_ends_every_worker_and_names_a_rank():
    import multiprocessing
    import time

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="timeout_s=3") as info:
        launch(_hang_on_rank_one, num_processes=2, cpu=True, echo=False, timeout_s=3)
    assert info.value.rank in (0, 1)
    assert time.monotonic() - t0 < 120
    assert multiprocessing.active_children() == []  # no worker left behind


def test_spawned_workers_run_a_closure_and_return_its_values():
    offset = 10
    res = launch(lambda x: __import__("torch.distributed").distributed.get_rank() + x + offset, 5,
                 num_processes=2, cpu=True, fresh_process=True, echo=False)
    assert res.how == "elastic_launch (spawn)" and res.results == [15, 16]


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_processes=0), "num_processes=0"),
    (dict(fresh_process="sometimes"), "fresh_process='sometimes'"),
])
def test_bad_arguments_name_the_value(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        launch(_who, "x", cpu=True, **kwargs)


def test_not_callable_is_refused():
    with pytest.raises(TypeError, match="not callable"):
        launch("train", cpu=True)


_ACCELERATE_STATE_SCRIPT = textwrap.dedent("""
    import colo_kit
    from accelerate import PartialState
    from colo_kit.parallel.launch import KernelNotSafe, kernel_problems, launch

    def rank_and_world():
        import torch.distributed as dist
        return dist.get_rank(), dist.get_world_size()

    if __name__ == "__main__":  # spawned workers import this script again as their main module
        PartialState(cpu=True)  # a trainer built in the kernel leaves this behind
        assert kernel_problems(), "the accelerate state was not noticed"
        try:
            launch(rank_and_world, num_processes=2, cpu=True, fresh_process=False)
        except KernelNotSafe as exc:
            assert "Fix:" in str(exc) and "fresh_process=True" in str(exc), exc
            print("REFUSED")
        res = launch(rank_and_world, num_processes=2, cpu=True, echo=False)  # auto: spawned instead
        print("FRESH", res.how, res.results)
""")


@pytest.mark.slow
def test_an_unsafe_kernel_is_refused_with_the_fix_or_launched_fresh(tmp_path):
    script = tmp_path / "unsafe.py"
    script.write_text(_ACCELERATE_STATE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED" in proc.stdout
    assert "FRESH elastic_launch (spawn) [(0, 2), (1, 2)]" in proc.stdout


_PARTIALSTATE_SCRIPT = textwrap.dedent("""
    import os, sys
    from accelerate import PartialState
    s = PartialState(cpu=sys.argv[1] == "cpu")
    # one file per torchrun worker: the two workers' prints on a shared stdout ran together
    with open(os.path.join(sys.argv[2], f"{sys.argv[1]}_{os.environ['RANK']}.txt"), "w") as f:
        f.write(f"STATE rank={s.process_index} world={s.num_processes} type={s.distributed_type}")
""")


@pytest.mark.slow
def test_partialstate_without_cpu_true_is_a_world_of_one(tmp_path):
    """Why every worker calls PartialState(cpu=True): under torchrun with 2 processes on a machine
    without a GPU, a bare PartialState() makes each process a world of one."""
    script = tmp_path / "state.py"
    script.write_text(_PARTIALSTATE_SCRIPT)
    worlds = {}
    for mode in ("plain", "cpu"):
        # a port the OS has just chosen for each run: the one above an earlier free port was in use under CI's load
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(script), mode, str(tmp_path)],
                              capture_output=True, text=True, timeout=180, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert proc.returncode == 0, proc.stderr[-2000:]
        worlds[mode] = sorted(p.read_text() for p in tmp_path.glob(f"{mode}_*.txt"))
        assert len(worlds[mode]) == 2, worlds
    assert all("world=1" in line and "DistributedType.NO" in line for line in worlds["plain"]), worlds
    assert worlds["cpu"] == ["STATE rank=0 world=2 type=DistributedType.MULTI_CPU",
                             "STATE rank=1 world=2 type=DistributedType.MULTI_CPU"]


@pytest.mark.slow
def test_in_a_real_kernel_logs_stream_into_the_cell_and_a_crash_leaves_the_kernel_alive():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(REPO_ROOT))
    try:
        def run(code: str, timeout: int = 240) -> tuple[str, dict | None]:
            out, err = [], None

            def hook(msg):
                nonlocal err
                if msg["msg_type"] == "stream":
                    out.append(msg["content"]["text"])
                elif msg["msg_type"] == "error":
                    err = msg["content"]

            reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
            assert reply["content"]["status"] in ("ok", "error")
            return "".join(out), err

        out, err = run(textwrap.dedent("""
            import colo_kit
            from colo_kit.parallel.launch import launch
            def hello(x):
                import torch.distributed as dist
                print("hello from rank", dist.get_rank(), flush=True)
                return (dist.get_rank(), dist.get_world_size(), x)
            res = launch(hello, 5, num_processes=2, cpu=True)
            print("RESULTS", res.results)
        """))
        assert err is None, err
        assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out
        assert "RESULTS [(0, 2, 5), (1, 2, 5)]" in out

        out, err = run(textwrap.dedent("""
            def crash():
                import torch.distributed as dist
                if dist.get_rank() == 0:
                    raise RuntimeError("worker zero fell over")
            launch(crash, num_processes=2, cpu=True)
        """))
        assert err is not None and err["ename"] == "WorkerError"
        assert "worker zero fell over" in err["evalue"]
        assert km.is_alive()
        out, err = run("print('still here', 6 * 7)")
        assert err is None and "still here 42" in out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_clean_process_is_safe_to_fork():
    # pytest's process has not touched CUDA (there is none here) nor built an Accelerator.
    assert kernel_problems() == []


@pytest.mark.gpu
def test_cuda_initialised_in_the_kernel_is_detected_and_launched_fresh():
    import torch

    torch.zeros(1, device="cuda")  # what a learner's earlier cell might have done
    assert any("CUDA is already initialised" in p for p in kernel_problems())
    with pytest.raises(KernelNotSafe, match="restart the kernel"):
        launch(_who, "x", fresh_process=False)
    res = launch(_who, "gpu")
    assert res.how == "elastic_launch (spawn)" and [r["rank"] for r in res.results] == list(range(len(res)))


_FORK_ON_GPU_SCRIPT = textwrap.dedent("""
    # Notebook 03's first cells on a GPU node: the kit, vLLM and TRL imported, the machine read,
    # then a forked launch that uses CUDA in every worker.
    import colo_kit, torch, vllm, trl
    from colo_kit.env import Machine
    from colo_kit.parallel.launch import kernel_problems, launch
    print("MACHINE", Machine.here(), "PROBLEMS", kernel_problems(), flush=True)

    def cuda_sum():
        import torch, torch.distributed as dist
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        return (dist.get_rank(), t.item(), torch.cuda.current_device())

    res = launch(cuda_sum, echo=False)
    print("LAUNCHED", res.how, res.results, flush=True)
""")


@pytest.mark.gpu
def test_a_gpu_node_forks_workers_that_use_cuda(tmp_path):
    # Seen on an H200 node before the fix: torch's LaunchConfig asked torch.cuda.is_available() in the
    # launching process, which initialised CUDA there, and every worker died with "Cannot re-initialize
    # CUDA in forked subprocess" although kernel_problems() had found nothing.
    from conftest import clean_env

    script = tmp_path / "fork_on_gpu.py"
    script.write_text(_FORK_ON_GPU_SCRIPT)
    env = {k: v for k, v in clean_env().items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}  # as a fresh kernel has it
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "PROBLEMS []" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LAUNCHED"))
    assert "elastic_launch (fork)" in line
    from colo_kit.env import gpu_count

    n = gpu_count()
    assert line.endswith(str([(r, float(n), r) for r in range(n)])), line


_PARENT_SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from colo_kit.procs import die_with_parent
    # a server's way of starting: a session of its own (a killpg of the parent's group misses it)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                             preexec_fn=die_with_parent)
    print(child.pid, flush=True)
    time.sleep(300)
""")


def test_a_server_started_in_its_own_session_dies_with_the_process_that_started_it(tmp_path):
    # Seen on an H200: a test run cut off by its time limit left its vLLM server holding 42 GiB of the
    # GPU, and the next notebook ran out of memory.
    import signal
    import time

    script = tmp_path / "parent.py"
    script.write_text(_PARENT_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive while its parent lives
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its parent")
