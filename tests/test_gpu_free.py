"""Before an engine starts: a GPU whose share another process holds is one line naming the processes and the fixes
(not vLLM's memory-profiling assert after the model loads). NVML's reading is given here; a GPU run reads it live."""

import pytest

from colo_kit.gpu_free import GpuBusy, check_share

H200 = 139.8


def _reading(free, others=()):
    return {"gpu": 0, "total_gib": H200, "free_gib": free, "others": list(others)}


def test_nvml_is_asked_for_the_gpu_cuda_visible_devices_names(monkeypatch):
    """CUDA numbers the GPUs CUDA_VISIBLE_DEVICES lists from 0, NVML does not; UUIDs keep NVML's order."""
    import sys
    from types import SimpleNamespace

    from colo_kit.gpu_free import nvml_device

    def no_bus_id(bus):
        raise RuntimeError(f"no GPU at {bus}")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByPciBusId=no_bus_id,
                                                               nvmlDeviceGetHandleByIndex=lambda i: f"handle {i}"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert nvml_device(1) == ("handle 6", 6) and nvml_device(1, physical=True) == ("handle 1", 1)
    import torch

    from colo_kit.colocate.sleep import _nvml_handle

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(pci_domain_id=0, pci_bus_id=0, pci_device_id=0))
    assert _nvml_handle("cuda:1") == "handle 6"  # sleep's fallback when the PCI bus id lookup fails
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f3c,GPU-9a1b")
    assert nvml_device(1) == ("handle 1", 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_device(1) == ("handle 1", 1)


def test_a_share_another_kernel_holds_is_one_line_with_the_fixes():
    busy = _reading(118.3, [{"pid": 4242, "gib": 21.5, "name": "python -m ipykernel_launcher"}])
    with pytest.raises(GpuBusy) as exc:
        check_share(0.9, reading=busy)
    message = str(exc.value)
    assert "\n" not in message
    assert "118.3 of 139.8 GiB free" in message and "125.8 GiB" in message  # 0.9 of an H200
    assert "pid 4242 (python -m ipykernel_launcher) 21.5 GiB" in message
    assert "Shut Down Kernel" in message
    suggested = float(message.rsplit("vllm_gpu_memory_utilization=", 1)[1].split()[0])
    assert suggested * H200 + 0.5 <= 118.3 and check_share(suggested, reading=busy) is busy  # the share it names fits


def test_a_free_share_passes_and_a_cpu_has_nothing_to_check(monkeypatch):
    assert check_share(0.3, reading=_reading(139.0))["free_gib"] == 139.0
    with pytest.raises(GpuBusy, match="no other process NVML can see"):
        check_share(0.3, reading=_reading(30.0))
    monkeypatch.setattr("colo_kit.env.has_cuda", lambda: False)
    assert check_share(0.9) is None


def test_a_plan_tried_in_a_child_names_where_it_stopped_and_a_gpu_run_owes_the_peak():
    """`try_plan` runs the real `colo-kit train` in a child process: a share the command refuses stops it before a
    model loads, and the result says so in the command's own line. Without a GPU there is no NVML peak; with one it is
    the GPU's whole use above where it started (a CUDA context, or another process's memory while the suite runs in
    lanes: seen 0.51 GiB on an H100), so only its presence is checked here. The peak of a run that trains is read on a
    GPU: notebook 04's break-it in the GPU Run All (`scripts/gpu/check.sh notebooks 04`)."""
    from colo_kit.env import has_cuda
    from colo_kit.labs.pitfalls import try_plan

    tried = try_plan(model="tiny", vllm_gpu_memory_utilization=1.5, per_device_train_batch_size=8,
                     gradient_checkpointing=True, max_completion_length=16, max_steps=1, timeout_s=120)
    assert tried["completed"] is False
    if has_cuda():
        assert isinstance(tried["nvml_peak_gib"], float) and tried["nvml_peak_gib"] >= 0, tried
    else:
        assert tried["nvml_peak_gib"] is None, tried
    assert "vllm_gpu_memory_utilization" in tried["error"] and "1.5" in tried["error"]
    assert tried["out_of_memory"] is False


def test_where_a_run_stopped_is_its_out_of_memory_line_before_any_other_error():
    from colo_kit.labs.pitfalls import _why

    lines = ["INFO loading", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
             "RuntimeError: Engine core initialization failed"]
    assert _why(lines, 1, 60).startswith("torch.OutOfMemoryError")
    assert _why(["ValueError: bad", "done"], 1, 60) == "ValueError: bad"
    busy = "colo_kit.gpu_free.GpuBusy: GPU 0 has 7.9 of 79.1 GiB free, but vllm_gpu_memory_utilization=0.9 needs"
    assert _why(["Traceback (most recent call last):", busy], 1, 60) == busy
    assert _why([], -9, 60).startswith("killed (after 60 s")
    assert _why(["last words"], 3, 60) == "last words"


@pytest.mark.parametrize("shares, says", [("0.3,x", "'x' is not a number"), ("1.5", "1.5 is not in (0, 1]"),
                                          ("nan", "nan is not in (0, 1]"), ("0", "0.0 is not in (0, 1]")])
def test_the_break_its_gpu_record_refuses_a_bad_share_in_one_line_before_anything_runs(shares, says, capsys):
    """scripts/share_by_hand.py (04's break-it, recorded on a GPU): a share that is not a fraction of the GPU is one
    line naming it and the form to give, exit code 2, before it looks for a GPU or writes anything."""
    import importlib.util

    from colo_kit_cli.commands import run
    from colo_kit.paths import REPO_ROOT

    spec = importlib.util.spec_from_file_location("share_by_hand", REPO_ROOT / "scripts" / "share_by_hand.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert run(script.main, ["--shares", shares], "scripts/share_by_hand.py") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says in err and "e.g. 0.3,0.9" in err
