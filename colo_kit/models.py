"""Offline models: real architectures with random weights, and a tokenizer made here. No machine the kit is tested on
reaches a hub, so `build_model("qwen2.5-1.5b")` writes Qwen2.5-1.5B-Instruct's exact shapes with random weights
(memory and timings are the real architecture's); `tiny` is it shrunk for a 2-core CPU."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from colo_kit.paths import cache_dir, data_dir

# Qwen2's chat template, reduced to the system and user turns and the generation prompt, with the same markup
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The regex Qwen2 uses to split text before byte-level BPE (from its tokenizer.json).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Preset:
    """The shape of a Qwen2 decoder; real sizes from the released Qwen2.5 Instruct (and Math) config.json files."""

    name: str
    hub_id: str | None
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    buildable: bool = True  # 72B is a config only: ~145 GB of bf16 weights cannot be built here
    bpe_vocab: int = 4000  # learned merges; the rest of vocab_size is filler tokens

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def shape(self) -> tuple:
        """The fields that decide the parameter count (name, context length and rope do not)."""
        return (self.hidden_size, self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads,
                self.intermediate_size, self.vocab_size, self.tie_word_embeddings)

    def layer_params(self) -> int:
        """One decoder layer of transformers' Qwen2: q (+bias), k, v (+bias), o; gate, up, down; two RMSNorms."""
        return _meta_param_counts(self.shape)[1]

    def num_params(self) -> int:
        """Parameters of transformers' Qwen2 with these shapes, tied embeddings once (released models to <0.1%)."""
        return _meta_param_counts(self.shape)[0]

    def lora_params(self, rank: int) -> int:
        """LoRA on every linear layer of the decoder (q, k, v, o, gate, up, down)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.kv_dim
        per_layer = rank * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
        return self.num_hidden_layers * per_layer


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        # vLLM's CPU attention needs head_dim >= 32; 4 heads of 32, GQA 2:1 like the real ones.
        Preset("tiny", None, 128, 2, 4, 2, 352, 2048, True, bpe_vocab=1500, max_position_embeddings=2048),
        Preset("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", 896, 24, 14, 2, 4864, 151936, True),
        Preset("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", 1536, 28, 12, 2, 8960, 151936, True),
        # 7B and 72B ship a 152064-row embedding (Qwen2.5's config.json), 0.5B/1.5B 151936.
        Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", 3584, 28, 28, 4, 18944, 152064, False),
        Preset("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", 8192, 80, 64, 8, 29568, 152064, False, buildable=False),
        # The posts' recipes: Math models have a 4k context and rope theta 10k.
        Preset("qwen2.5-math-1.5b", "Qwen/Qwen2.5-Math-1.5B", 1536, 28, 12, 2, 8960, 151936, True,
               rope_theta=10_000.0, max_position_embeddings=4096),
        Preset("qwen2.5-math-72b", "Qwen/Qwen2.5-Math-72B", 8192, 80, 64, 8, 29568, 152064, False,
               rope_theta=10_000.0, max_position_embeddings=4096, buildable=False),
    ]
}


def get_preset(name: str) -> Preset:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} "
                         "or pass a hub id such as 'Qwen/Qwen2.5-1.5B-Instruct'")
    return PRESETS[key]


def qwen2_config(preset: Preset):
    """A transformers `Qwen2Config` with the preset's shapes; no token ids (build_model sets them from its tokenizer)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rope_theta=preset.rope_theta,
        rms_norm_eps=preset.rms_norm_eps,
        tie_word_embeddings=preset.tie_word_embeddings,
        torch_dtype="bfloat16",
    )


@functools.lru_cache(maxsize=None)
def _meta_param_counts(shape: tuple) -> tuple[int, int]:
    """(whole model, one decoder layer) of the real architecture, built on the meta device; cached on disk too, since
    importing torch and transformers is most of `colo-kit plan`'s time."""
    key = json.dumps(list(shape))
    path = cache_dir() / "param_counts.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), list) and len(known[key]) == 2:
        return tuple(known[key])
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen2_config(Preset("count", None, *shape)))
    # parameters() yields a tied embedding / LM head once
    counts = (sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.model.layers[0].parameters()))
    with contextlib.suppress(OSError):  # a read-only cache only costs the next process the build again
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**(known if isinstance(known, dict) else {}), key: list(counts)}))
        os.replace(tmp, path)
    return counts


def _training_text() -> list[str]:
    """The BPE's training text: the kit's prompt sets plus digits and LaTeX, so math prompts tokenise sensibly."""
    lines: list[str] = []
    for name in ("tldr_prompts.jsonl", "math_problems.jsonl"):
        path = data_dir() / name
        if path.exists():
            for row in path.read_text().splitlines():
                rec = json.loads(row)
                lines.extend(str(v) for v in rec.values() if isinstance(v, str))
    lines += ["\\boxed{" + str(i) + "} \\frac{1}{" + str(i) + "}" for i in range(200)]
    return lines


def build_tokenizer(vocab_size: int, bpe_vocab: int):
    """A byte-level BPE tokenizer with Qwen2's pre-tokenizer and decoder (what transformers' `Qwen2Tokenizer` rebuilds
    from vocab and merges); the ids past the learned merges are filler tokens that decode, as the model samples them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
                                  show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)

    # filler tokens after the learned vocab, then the special tokens at the very end, as in Qwen2
    n_special = len(SPECIAL_TOKENS)
    learned = tok.get_vocab_size()
    n_fill = vocab_size - learned - n_special
    if n_fill < 0:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the learned BPE vocab ({learned}) "
                         f"plus {n_special} special tokens; raise vocab_size or lower bpe_vocab")
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for k in range(n_fill):
        vocab[f"<fill{k}>"] = learned + k
    tok = Tokenizer.from_str(json.dumps(state))
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=32768, chat_template=CHAT_TEMPLATE)


def model_dir(preset_name: str) -> Path:
    return cache_dir() / "models" / preset_name


def build_model(preset_name: str = "tiny", *, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the preset's model folder and return its path; one without its `colo_kit.json` marker is rebuilt."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    preset = get_preset(preset_name)
    if not preset.buildable:
        raise ValueError(f"preset {preset.name!r} is a config only (about {preset.num_params() / 1e9:.0f}B "
                         "parameters, too big to build here); use it with colo_kit.memory.planner, or pass its "
                         f"hub id {preset.hub_id!r} on a machine that can download it")
    out = model_dir(preset.name if seed == 0 else f"{preset.name}-seed{seed}")  # one folder per seed
    marker = out / "colo_kit.json"
    if marker.exists() and not force:
        return out

    # a folder of this process's own: two kernels building the same preset at once must not share a half-built one
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    try:
        tokenizer = build_tokenizer(preset.vocab_size, preset.bpe_vocab)
        config = qwen2_config(preset)
        config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

        torch.manual_seed(seed)
        # 7B's init takes minutes on a CPU; smaller presets keep the CPU's generator: one seed, one set of weights anywhere
        device = "cuda" if preset.num_params() > 3e9 and torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "colo_kit.json").write_text(json.dumps({"preset": asdict(preset), "seed": seed, "dtype": "bfloat16",
                                                        "random_weights": True, "init_device": device}, indent=1))
    except BaseException:  # a failed or interrupted build leaves no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if marker.exists() and not force:  # another process finished the same build first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.exists():
        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not marker.exists():
            raise
    return out


def resolve_model(name_or_path: str = "tiny", *, build: bool = True) -> str:
    """Where to load a model from: a folder as is, a preset built offline and cached (`build=False`: only checked),
    a hub id unchanged for transformers and vLLM to download."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise ValueError(f"model={name_or_path!r}: give a preset ({sorted(PRESETS)}), a folder or a hub id")
    name_or_path = str(name_or_path)
    if os.path.isdir(name_or_path):
        return str(name_or_path)
    if name_or_path.lower() in PRESETS:
        if not build:
            preset = get_preset(name_or_path)
            if not preset.buildable:
                build_model(name_or_path)  # raises the config-only error
            return str(model_dir(preset.name))
        return str(build_model(name_or_path))
    if "/" in name_or_path:
        return name_or_path
    raise ValueError(f"{name_or_path!r} is neither a local folder, a preset ({sorted(PRESETS)}) nor a hub id "
                     "like 'Qwen/Qwen2.5-1.5B-Instruct'")


def default_preset() -> str:
    """`tiny` on CPU, the post's 0.5B on a GPU machine."""
    from colo_kit.env import has_cuda

    return "qwen2.5-0.5b" if has_cuda() else "tiny"
