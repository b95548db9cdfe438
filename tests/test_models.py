"""Offline models: real Qwen2 shapes, a tokenizer that survives transformers 5's rebuild, vLLM loads them."""

import json
import os
from pathlib import Path

import pytest

from colo_kit.models import PRESETS, build_model, get_preset, resolve_model

# Published config.json values of the Qwen2.5 Instruct models (hidden, layers, heads, kv heads,
# intermediate, vocab, tied) and their published parameter counts in billions.
PUBLISHED = {
    "qwen2.5-0.5b": ((896, 24, 14, 2, 4864, 151936, True), 0.494),
    "qwen2.5-1.5b": ((1536, 28, 12, 2, 8960, 151936, True), 1.544),
    "qwen2.5-7b": ((3584, 28, 28, 4, 18944, 152064, False), 7.616),
    "qwen2.5-72b": ((8192, 80, 64, 8, 29568, 152064, False), 72.71),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_shapes_and_sizes(name):
    p = get_preset(name)
    shape, billions = PUBLISHED[name]
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
            p.intermediate_size, p.vocab_size, p.tie_word_embeddings) == shape
    # num_params() counts transformers' Qwen2 built on the meta device
    assert p.num_params() / 1e9 == pytest.approx(billions, rel=1e-3)
    assert p.rope_theta == 1_000_000.0


def test_parameter_counts_are_those_of_the_built_tiny_model(tiny_model_path, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    from colo_kit.models import _meta_param_counts

    monkeypatch.setenv("COLO_KIT_CACHE", str(tmp_path))  # counted now, not read from an earlier run's cache
    _meta_param_counts.cache_clear()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tiny = get_preset("tiny")
    assert tiny.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tiny.num_params() == sum(p.numel() for p in model.parameters())  # the tied matrix once
    assert tiny.layer_params() == sum(p.numel() for p in model.model.layers[0].parameters())


def test_counts_are_kept_on_disk_for_the_next_process(monkeypatch, tmp_path):
    """`colo-kit plan` need not import torch and transformers again to count a model it counted before."""
    import json

    from colo_kit.models import _meta_param_counts

    monkeypatch.setenv("COLO_KIT_CACHE", str(tmp_path))
    _meta_param_counts.cache_clear()
    seven = get_preset("qwen2.5-7b")
    counted = seven.num_params()
    kept = json.loads((tmp_path / "param_counts.json").read_text())
    assert list(kept.values()) == [[counted, seven.layer_params()]]
    (tmp_path / "param_counts.json").write_text(json.dumps({k: [1, 2] for k in kept}))
    _meta_param_counts.cache_clear()
    assert (seven.num_params(), seven.layer_params()) == (1, 2)  # read back, not counted again
    _meta_param_counts.cache_clear()


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-7b"])  # tied and untied, GQA 2:1 and 7:1
def test_lora_params_is_what_peft_adds(name):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from colo_kit.models import qwen2_config

    p = get_preset(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen2_config(p))
    lora = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]))
    assert p.lora_params(16) == lora.get_nb_trainable_parameters()[0]


def test_tiny_fits_vllm_cpu_attention():
    assert get_preset("tiny").head_dim >= 32  # vLLM's CPU attention needs head size >= 32


def test_unknown_preset_and_72b_build_fail_clearly():
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
        get_preset("qwen9")
    with pytest.raises(ValueError, match="config only"):
        build_model("qwen2.5-72b")
    with pytest.raises(ValueError, match="neither a local folder"):
        resolve_model("not-a-model")


def test_hub_id_passes_through_unchanged():
    assert resolve_model("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"


def test_tiny_folder_loads_in_transformers_with_a_working_tokenizer(tiny_model_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model_path)
    assert cfg.model_type == "qwen2" and cfg.vocab_size == PRESETS["tiny"].vocab_size
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert len(tok) == cfg.vocab_size
    text = "TL;DR: my roommate ate 12 of my 20 dumplings \\boxed{\\frac{3}{5}}"
    ids = tok(text)["input_ids"]
    # The failure this guards against: a tokenizer rebuilt by transformers 5 that encodes prompts to nothing.
    assert len(ids) > 5
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    # every id the model can sample decodes to text
    every = tok.batch_decode([[i] for i in range(cfg.vocab_size)])
    assert all(isinstance(s, str) for s in every) and sum(1 for s in every if s) >= cfg.vocab_size - 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.lm_head.weight.shape[0] == cfg.vocab_size
    meta = json.loads((__import__("pathlib").Path(tiny_model_path) / "colo_kit.json").read_text())
    assert meta["random_weights"] is True
    assert meta.get("init_device", "cpu") == "cpu"  # a small preset's weights are the same on every machine


def test_build_is_cached(tiny_model_path):
    import os

    before = os.stat(tiny_model_path + "/model.safetensors").st_mtime
    assert str(build_model("tiny")) == tiny_model_path
    assert os.stat(tiny_model_path + "/model.safetensors").st_mtime == before


def test_two_processes_building_one_preset_at_once_both_get_the_whole_model(tmp_path):
    """Two kernels of a workshop (or two test workers) building `tiny` in the same second: each writes a folder of
    its own and the first to finish wins; both load the same whole model."""
    import subprocess
    import sys

    env = {**os.environ, "COLO_KIT_CACHE": str(tmp_path)}
    code = "from colo_kit.models import build_model; print(build_model('tiny'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    built = Path(outs[0])
    assert (built / "colo_kit.json").exists() and (built / "config.json").exists()
    assert not list(built.parent.glob("*.partial*"))
