"""A second engine built in one process, with CUDA graphs on (GPU only). In a module of its own: test_engine.py's
module-wide engine holds its share of the GPU until that module ends, and this test's fresh interpreter needs the
GPU free of it."""

import subprocess
import sys

import pytest

from colo_kit.paths import REPO_ROOT

_TWO_ENGINES_SCRIPT = """
import colo_kit
from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings
from colo_kit.grpo.train import run_grpo

settings = ColocateSettings(per_device_train_batch_size=4, max_prompt_length=64, max_completion_length=16,
                            vllm_gpu_memory_utilization=0.2)
for i in (1, 2):  # CUDA graphs on (the GPU default): the second capture is the one that failed
    engine = ColocatedEngine("tiny", settings)
    print("ENGINE", i, len(engine.generate(["x"], max_tokens=4, ignore_eos=True).completion_ids[0]), flush=True)
    engine.close()
run = run_grpo("tiny", "colocate", max_steps=2, per_device_train_batch_size=4, num_generations=4,
               max_completion_length=8)
print("TRL", len(run.steps), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.slow
def test_engines_built_one_after_another_in_one_process_capture_their_cuda_graphs(tmp_path):
    """What a learner does when re-running a notebook cell: a second engine in the same process.
    Seen on an H200 before the fix: `it->second->use_count > 0 INTERNAL ASSERT FAILED` in PyTorch's
    caching allocator while the later engine captured its CUDA graphs (vLLM's process-wide graph
    pool outlived the first engine). Run in a fresh interpreter so a failure cannot poison pytest's."""
    from conftest import clean_env

    from colo_kit.colocate.vllm_compat import make_room_for_an_engine
    from colo_kit.gpu_free import read_gpu

    make_room_for_an_engine()  # engines earlier tests of this pytest process dropped: their memory back to the driver
    before = read_gpu(0)

    script = tmp_path / "two_engines.py"
    script.write_text(_TWO_ENGINES_SCRIPT)
    env = {**clean_env(), "COLO_KIT_VLLM_EAGER": "0"}  # graphs on, as a learner's engines have them
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"GPU before: {before}\n" + proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "ENGINE 1 4" in proc.stdout and "ENGINE 2 4" in proc.stdout and "TRL 2" in proc.stdout
