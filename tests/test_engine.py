"""colo_kit.colocate.engine on the real vLLM CPU engine: settings, generation, TP=2 over two processes,
weight pushes (plain and PEFT) that change and restore the outputs."""

import json
import os
import subprocess
import sys

import pytest

from colo_kit.colocate.engine import ColocateSettings
from colo_kit.grpo.train_checks import model_max_positions
from colo_kit.paths import REPO_ROOT


# -- settings (no engine) -------------------------------------------------------------------------

def test_settings_follow_the_post():
    s = ColocateSettings(vllm_tensor_parallel_size=2, per_device_train_batch_size=4, gradient_accumulation_steps=3,
                         max_prompt_length=100, max_completion_length=28)
    assert s.max_num_seqs == 4 * 2 * 3
    assert s.max_model_len == 128
    assert s.validate(world_size=4) is s


@pytest.mark.parametrize("kwargs, world, words", [
    ({"vllm_tensor_parallel_size": 3}, 2, ["vllm_tensor_parallel_size=3", "world size 2", "[1, 2]"]),
    ({"vllm_tensor_parallel_size": 0}, 1, ["vllm_tensor_parallel_size=0", "positive"]),
    ({"vllm_gpu_memory_utilization": 0.0}, 1, ["vllm_gpu_memory_utilization=0.0", "(0, 1]"]),
    ({"vllm_gpu_memory_utilization": 1.5}, 1, ["vllm_gpu_memory_utilization=1.5", "(0, 1]"]),
    ({"per_device_train_batch_size": -1}, 1, ["per_device_train_batch_size=-1"]),
])
def test_bad_settings_name_the_value(kwargs, world, words):
    with pytest.raises(ValueError) as err:
        ColocateSettings(**kwargs).validate(world_size=world)
    for w in words:
        assert w in str(err.value)


def test_lengths_over_the_model_limit(tiny_model_path):
    limit = model_max_positions(tiny_model_path)
    assert limit == 2048
    with pytest.raises(ValueError, match=r"2000 \+ 100 = 2100 exceeds the model's limit of 2048"):
        ColocateSettings(max_prompt_length=2000, max_completion_length=100).validate(1, limit)


# -- one real engine for the module ---------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model_path):
    import os

    from colo_kit.colocate.engine import ColocatedEngine

    before = dict(os.environ)  # the engine writes RANK/MASTER_PORT; don't leak them past this module
    eng = ColocatedEngine(tiny_model_path, ColocateSettings(per_device_train_batch_size=4, max_prompt_length=64,
                                                            max_completion_length=16), enforce_eager=True)
    yield eng
    eng.close()
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)


@pytest.mark.slow
def test_generate_returns_ids_text_and_logprobs(engine):
    out = engine.generate(["Summarise: the cat sat.", [1, 2, 3, 4]], n=3, max_tokens=8, ignore_eos=True)
    assert len(out.completion_ids) == len(out.texts) == len(out.logprobs) == len(out.prompt_ids) == 6
    assert all(len(ids) == 8 for ids in out.completion_ids)
    assert out.prompt_ids[3] == [1, 2, 3, 4]  # prompt-major: completions 3..5 belong to prompt 1
    assert all(len(lp) == 8 and all(v <= 0.0 for v in lp) for lp in out.logprobs)
    assert out.texts[0] == engine.tokenizer.decode(out.completion_ids[0])
    assert out.num_completion_tokens == 48
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([])


@pytest.mark.slow
def test_weight_push_changes_outputs_and_pushing_back_restores_them(engine, hf_model):
    import torch

    base = engine.probe()
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * p.float().std().clamp(min=1e-3).to(p.dtype))
    engine.push_weights(hf_model)
    perturbed = engine.probe()
    assert perturbed["token_ids"] != base["token_ids"]

    hf_model.load_state_dict(original)
    engine.push_weights(hf_model)
    back = engine.probe()
    assert back["token_ids"] == base["token_ids"]
    assert max(abs(a - b) for a, b in zip(back["logprobs"], base["logprobs"])) < 1e-4


@pytest.mark.slow
def test_peft_push_merges_the_adapter(engine, hf_model):
    import torch
    from peft import LoraConfig, get_peft_model

    base = engine.probe()
    peft_model = get_peft_model(hf_model, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"]))
    try:
        torch.manual_seed(2)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        engine.push_weights(peft_model)
        assert engine.probe()["token_ids"] != base["token_ids"]
        # The adapter is unmerged again: the trainer keeps training the adapter, not merged weights.
        assert not any(getattr(m, "merged", False) for m in peft_model.modules())
    finally:
        hf_model = peft_model.unload()
    engine.push_weights(hf_model)
    assert engine.probe()["token_ids"] == base["token_ids"]


def test_the_check_command_takes_trls_names_only(monkeypatch, capsys):
    from colo_kit_cli.commands import run
    from colo_kit_cli import engine_check

    class Built(Exception):
        pass

    def engine(model, settings):  # stands in for the engine: only what it is built from matters here
        raise Built(model, settings)

    monkeypatch.setattr(engine_check, "ColocatedEngine", engine)
    with pytest.raises(Built) as built:  # TRL's names only: the kit's old --tp and --max-tokens are gone
        engine_check.main(["--model", "m", "--vllm-tensor-parallel-size", "2", "--max_completion_length", "6",
                           "--sampled", "--push", "--out-dir", "d"])
    model, s = built.value.args
    assert (model, s.vllm_tensor_parallel_size, s.max_completion_length) == ("m", 2, 6)
    assert run(engine_check.main, ["--vllm-tensor-parallel-size", "two"], engine_check.PROG) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("invalid int value: 'two'"), err
    assert run(engine_check.main, ["--tp", "2"], engine_check.PROG) == 2


@pytest.mark.slow
@pytest.mark.devices(2)
def test_tp2_under_two_processes_agree(free_port, tmp_path):
    """torchrun, 2 processes, gloo, TP=2: the two engines are one model. Both must produce the same
    group completions (sampled, seed = rank // tp), and each rank keeps the completions of its own prompts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port),
           "-m", "colo_kit_cli.engine_check", "--vllm-tensor-parallel-size", "2", "--sampled", "--push",
           "--max-completion-length", "6",
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in recs] == [0, 1]
    assert [r["seed"] for r in recs] == [0, 0]
    assert recs[0]["group_sampled"] == recs[1]["group_sampled"]
    assert len(recs[0]["group_sampled"]) == 4
    # A weight push under TP=2: each rank keeps its shard; the same weights leave the probe as it
    # was, perturbed ones change it, identically on both ranks.
    assert all(r["push_same_probe"] for r in recs)
    assert recs[0]["push_perturbed_probe"] == recs[1]["push_perturbed_probe"] != recs[0]["probe"]
    for r in recs:
        assert r["prompt_texts"] == r["prompts"]  # this rank's slice is its own prompts
        assert len(r["greedy"]) == 2 and all(len(c) == 6 for c in r["greedy"])


def _hf_logprobs(model, prompt_ids, completion_ids):
    """Log-probabilities the trainer's model gives the engine's completion tokens."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt_ids) - 1:-1], dim=-1)
    return logp.gather(1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


@pytest.mark.slow
def test_after_a_push_engine_and_trainer_agree_on_logprobs(engine, hf_model):
    """The engine must sample from the trainer's weights — all of them, including the LM head that
    Qwen2 ties to the embedding (vLLM's CPU reload refreshes only one side of a tie)."""
    import torch

    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    torch.manual_seed(3)
    try:
        with torch.no_grad():
            for p in hf_model.parameters():
                p.add_(torch.randn_like(p) * p.float().std().clamp(min=1e-3).to(p.dtype))
        engine.push_weights(hf_model)
        out = engine.generate(["The trainer and the engine"], max_tokens=12, temperature=0.0, ignore_eos=True)
        hf = _hf_logprobs(hf_model, out.prompt_ids[0], out.completion_ids[0])
        gap = max(abs(a - b) for a, b in zip(hf, out.logprobs[0]))
        assert gap < 0.1, f"engine and trainer disagree by {gap:.3f} nats after a push"
    finally:
        hf_model.load_state_dict(original)
        engine.push_weights(hf_model)


# -- the engine against TRL's installed code (no engine) --------------------------------------------

class _RecordingLLM:
    """Stands in for vLLM's `LLM` while TRL's `_init_vllm` runs: keeps the arguments it was given."""

    calls: list = []

    def __init__(self, **kwargs):
        type(self).calls.append(kwargs)

    def sleep(self, level):
        pass


@pytest.mark.parametrize("tp, rank, completion, sleep", [(1, 0, 32, False), (2, 3, 64, True), (2, 2, 6000, False)])
def test_the_engine_is_trls_own_but_for_the_named_llm_arguments(monkeypatch, tiny_model_path, tp, rank, completion,
                                                                   sleep):
    """The engine is built by TRL's `VLLMGeneration.__init__` (here with a recording LLM): TRL makes the TP groups
    over consecutive ranks and picks the seed, and the `LLM` gets TRL's arguments with only the kit's named
    overrides changed. A TRL upgrade that changes an argument still reaches the engine; one the kit overrides
    fails here."""
    import torch.distributed
    import trl.generation.vllm_generation as vg

    from colo_kit.colocate.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, build_trl_generation, kit_llm_overrides

    world = 4
    settings = ColocateSettings(vllm_tensor_parallel_size=tp, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                max_prompt_length=64, max_completion_length=completion, vllm_enable_sleep_mode=sleep)
    groups = []
    monkeypatch.setattr(vg, "LLM", _RecordingLLM)
    monkeypatch.setattr(torch.distributed, "new_subgroups_by_enumeration", lambda g: (groups.append(g), None))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    _RecordingLLM.calls = []
    overrides = kit_llm_overrides(settings)
    gen, trl, built = build_trl_generation(tiny_model_path, settings, rank=rank, local_rank=rank, world_size=world,
                                           **overrides)
    assert vg.LLM is _RecordingLLM  # TRL's LLM is given back
    (engine_args,) = _RecordingLLM.calls
    assert engine_args == built
    assert set(built) - set(trl) == {"dtype", "enforce_eager"}  # added by the kit, nothing else
    differ = {k for k in trl if built[k] != trl[k]}
    expect = {"enable_sleep_mode"} if sleep else set()
    if settings.max_model_len > DEFAULT_MAX_NUM_BATCHED_TOKENS:  # vLLM refuses fewer without chunked prefill
        expect.add("max_num_batched_tokens")
        assert (trl["max_num_batched_tokens"], built["max_num_batched_tokens"]) == (4096, settings.max_model_len)
    assert differ == expect, {k: (built[k], trl[k]) for k in differ}
    assert trl["seed"] == rank // tp and trl["max_num_seqs"] == settings.max_num_seqs
    assert groups == ([[list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]] if tp > 1 else [])
    assert gen.enable_sleep_mode is False and gen.mode == "colocate"  # TRL's own sleeping stays off


def test_each_idea_the_engine_teaches_is_found_in_the_installed_trl():
    """`where_in_trl()` names file:line for every idea; the line is really there (notebook 02 shows the table)."""
    import inspect
    from pathlib import Path

    import trl

    from colo_kit.colocate.engine import TRL_LINES, where_in_trl

    rows = where_in_trl()
    assert [r["idea"] for r in rows] == [idea for idea, _, _ in TRL_LINES]
    trl_root = Path(inspect.getsourcefile(trl)).parent.parent
    for row, (_, _, needle) in zip(rows, TRL_LINES):
        path, line = row["where"].rsplit(":", 1)
        assert needle in (trl_root / path).read_text().splitlines()[int(line) - 1], row


def test_trls_weight_walk_gives_the_base_models_names_for_a_peft_model(hf_model):
    """The walk the engine pushes with (TRL's `_iter_named_params`): a PEFT model's weights come out
    merged, under the plain model's names (the ones vLLM's loader maps), with no LoRA tensor, and
    the adapter is unmerged afterwards."""
    import types

    import torch
    from peft import LoraConfig, get_peft_model
    from trl.distributed import DistributedBackend

    from trl.generation.vllm_generation import VLLMGeneration

    plain_names = [n for n, _ in hf_model.named_parameters()]
    q_before = hf_model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    peft_model = get_peft_model(hf_model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    try:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.1)
        gen = VLLMGeneration.__new__(VLLMGeneration)  # only the walk runs here: no engine is needed
        gen.model = peft_model
        gen._dist = DistributedBackend(types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=None)))
        walked = {n: t.detach().clone() for n, t in gen._iter_named_params()}
        assert list(walked) == plain_names
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(walked[q], q_before)  # merged: base + B @ A
        assert not any(getattr(m, "merged", False) for m in peft_model.modules())
    finally:
        peft_model.unload()
