"""Before an engine starts: a GPU whose share another process holds is one line naming the processes and the fixes
(not vLLM's memory-profiling assert after the model loads). NVML's reading is given here; a GPU run reads it live."""

import pytest

from colo_kit.gpu_free import GpuBusy, check_share

H200 = 139.8


def _reading(free, others=()):
    return {"gpu": 0, "total_gib": H200, "free_gib": free, "others": list(others)}


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
