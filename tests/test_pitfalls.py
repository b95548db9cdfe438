"""The break-it labs break what they say and the fix fixes it, on the real parts (TRL's trainer, vLLM's engine)."""

import math

import pytest


@pytest.mark.slow
def test_top_p_below_one_collapses_trls_sequence_ratio_and_top_p_one_does_not():
    from colo_kit.labs.pitfalls import top_p_breaks_importance_sampling

    broken, fixed = top_p_breaks_importance_sampling("tiny", top_ps=(0.8, 1.0), vllm_enforce_eager=True)
    gap = broken["vLLM vs trainer log-prob gap (nats/token)"]
    # the tiny random model is near uniform: each kept token's probability is divided by the kept mass
    assert gap == pytest.approx(-math.log(0.8), abs=0.05)
    assert broken["IS ratio mean (TRL's log)"] < 0.05
    assert 0.9 < fixed["IS ratio mean (TRL's log)"] < 1.1
    assert fixed["vLLM vs trainer log-prob gap (nats/token)"] < 0.02


@pytest.mark.slow
@pytest.mark.devices(2)  # a TP-2 engine: two CPU processes, or two GPUs (one GPU cannot hold it)
def test_one_seed_per_tp_worker_makes_the_workers_disagree_and_trls_rule_does_not():
    from colo_kit.labs.pitfalls import tp_seed_rule

    trl_rule, per_worker = tp_seed_rule("tiny", max_tokens=16)
    assert trl_rule["same token on both workers"] == 1.0
    assert per_worker["same token on both workers"] < 0.5


def test_break_its_name_the_choices_when_a_marked_value_is_mistyped():
    from colo_kit.labs.pitfalls import one_adapter_name, tp_seed_rule

    with pytest.raises(ValueError, match="use one of"):
        tp_seed_rule("tiny", rules=("seed = 0",))
    with pytest.raises(ValueError, match="versioned"):
        one_adapter_name("http://127.0.0.1:1", None, None, None, "/tmp", publish=("one-name",))


@pytest.mark.slow
def test_lost_buffers_change_the_probe_and_restoring_them_brings_it_back():
    import torch
    from transformers import AutoModelForCausalLM

    from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings
    from colo_kit.labs.pitfalls import lost_buffers

    engine = ColocatedEngine("tiny", ColocateSettings(max_prompt_length=64, max_completion_length=16),
                             enforce_eager=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.bfloat16)
        first = engine.probe()
        built, lost = lost_buffers(engine, model, restore=False)  # notebook 02's marked value, as shipped
        assert "rotary_emb" in built["buffers"]
        assert lost["max |log-prob change|"] > 0.1
        assert engine.probe()["logprobs"] == first["logprobs"]  # the engine gets its buffers back for the next cells
        _, restored = lost_buffers(engine, model, restore=True)  # the learner's fix
        assert restored["same tokens"] and restored["max |log-prob change|"] == 0.0
    finally:
        engine.close()
