"""The ping-pong model: its algebra, its explanation of the 2-GPU measurement, and its error on
the committed measurements (leave-one-out, <= 10% is the issue's bar)."""

import math

import pytest

from colo_kit.serving.bench import load_result
from colo_kit.serving import pingpong
from colo_kit.serving.pingpong import PhaseCosts, fit_costs, predict, speedup, validate


def costs(gen_growth=True):
    # generation cost that grows sub-linearly with the batch, as memory-bound decoding does
    pts = [(8, 4.0), (64, 5.0), (448, 12.0)] if gen_growth else [(8, 4.0), (448, 4.0)]
    return PhaseCosts(gen_points=pts, train_fixed_s=0.5, train_per_sample_s=0.02, sync_server_s=0.3,
                      sync_colocate_s=0.1, tokens_per_sample=256)


def test_gen_interpolates_and_extrapolates():
    c = costs()
    assert c.gen(8) == 4.0 and c.gen(64) == 5.0
    assert c.gen(36) == pytest.approx(4.5)
    assert c.gen(2) == 4.0  # below the smallest measurement: the smallest
    assert c.gen(448 + 384) == pytest.approx(12.0 + 7.0 / 384 * 384)


def test_two_devices_are_one_to_one_per_device():
    """N=2, k=1: the server generates what one colocated device generates -> ~2x raw, ~1x normalised."""
    c = costs()
    s = speedup(c, 2, 64, 1)
    assert s["raw"] == pytest.approx(2 * s["normalised"])
    # only the sync difference separates the modes per device
    step_s, step_c = c.gen(64) + 0.3 + c.train(64), c.gen(64) + 0.1 + c.train(64)
    assert s["normalised"] == pytest.approx(step_s / step_c, rel=1e-3)


def test_eight_devices_gain_grows_with_generation_cost_of_seven_batches():
    c = costs()
    s8 = speedup(c, 8, 64, 1)
    s2 = speedup(c, 2, 64, 1)
    assert s8["normalised"] > s2["normalised"] + 0.3
    flat = speedup(costs(gen_growth=False), 8, 64, 1)  # if generating 7x costs nothing more: no gain
    assert flat["normalised"] < s8["normalised"]
    assert 0 < s8["server_trainer_idle"] < 1 and 0 < s8["server_vllm_idle"] < 1


def test_predict_rejects_bad_configs():
    with pytest.raises(ValueError, match="N - k"):
        predict(costs(), "server", 1, 8, 1)
    with pytest.raises(ValueError, match="mode="):
        predict(costs(), "plain", 2, 8)
    with pytest.raises(ValueError, match="no usable"):
        fit_costs([{"label": "x", "mode": "server", "error": "boom"}])


def test_slower_training_moves_the_eight_gpu_ratio_towards_one():
    c = costs()
    slow = c.with_training(4.0)
    assert slow.train(32) == pytest.approx(4 * c.train(32)) and slow.gen(448) == c.gen(448)
    assert 1 < speedup(slow, 8, 64)["normalised"] < speedup(c, 8, 64)["normalised"]
    assert slow.notes == ["training x4 (a what-if)"] and c.with_training(1.0).notes == []


def test_step_time_for_a_target_gives_that_target_back():
    """The rest of a step the post's 1.43x needs: fed back into the model, it returns 1.43x."""
    c = costs()
    need = pingpong.step_time_for(c, 1.43, 64)
    extra = need["rest_of_step_for_target_s"] - need["rest_of_step_modelled_s"]
    assert extra > 0 and need["generation_share_for_target"] < need["generation_share_modelled"]
    padded = PhaseCosts(**{**c.to_dict(), "other_server_s": c.other_server_s + extra,
                           "other_colocate_s": c.other_colocate_s + extra})
    assert speedup(padded, 8, 64)["normalised"] == pytest.approx(1.43, abs=0.01)
    with pytest.raises(ValueError, match="above 1"):
        pingpong.step_time_for(c, 0.9, 64)


def test_model_on_committed_cpu_measurements():
    """On CPU the two "devices" are two processes on the same 2 cores, so the model's premise
    (independent devices) does not hold; the table must still cover every run, with finite errors."""
    res = load_result("pingpong_cpu")
    if res is None:
        pytest.skip("results/pingpong_cpu.json not committed yet")
    rows = validate(res["runs"], res.get("gen_probe", []))
    plain = [r for r in res["runs"] if "error" not in r and r["label"].startswith(("server-b", "colocate-b"))]
    assert len([r for r in rows if r["method"] == "leave-one-out"]) == len(plain)
    assert len([r for r in rows if r["method"] == "cross-mode"]) == len([r for r in plain if r["mode"] == "colocate"])
    assert all(math.isfinite(r["error_pct"]) for r in rows)


def test_costs_from_the_h200_speed_runs_are_gpu_costs_the_projection_can_use():
    """Without a committed ping-pong sweep, notebook 01 projects from these (never from CPU costs)."""
    import json

    from colo_kit.paths import REPO_ROOT

    from record.lessons import costs_from_speed

    result = json.loads((REPO_ROOT / "results" / "speed_1xh200.json").read_text())
    costs = costs_from_speed(result)
    batches = [b for b, _ in costs.gen_points]
    assert batches == [8, 64, 256]
    times = [t for _, t in costs.gen_points]
    assert times == sorted(times) and times[0] > 0.1  # decoding 256 tokens takes a while, more so for more sequences
    assert costs.train_per_sample_s > 0 and costs.sync_server_s > 0
    assert "assumption" in costs.notes[0]
    # one trainer per server: the same per-device work in both modes, so the per-device ratio is 1
    assert pingpong.speedup(costs, 2, 64)["normalised"] == pytest.approx(1.0)
    # one server for seven trainers: it generates 7b while they wait
    assert all(r["normalised"] > 1 for r in pingpong.project_post(costs))
    # 7B: its own measured points (8 and 16 completions per call, batch-8 training), slower than the 1.5B's
    from record.lessons import costs_7b_from_speed

    big = costs_7b_from_speed(result, costs)
    assert [b for b, _ in big.gen_points][:2] == [8, 16] and big.gen(8) > 1.5 * costs.gen(8)
    assert big.train(8) > 1.5 * costs.train(8) and big.sync_server_s > 0 and "rule" in big.notes[0]
