"""A model's shape for the planner: a preset, an HF config.json (file or folder) or a config dict, read offline
by transformers (`AutoConfig`), as a `colo_kit.models.Preset` whose counts the planner sizes memory from."""

from __future__ import annotations

import json
from pathlib import Path

from colo_kit.models import Preset

MAX_PARAMS = 1e13  # ten trillion: past any model trained today, and torch cannot even lay out the meta tensors

def model_shape(model) -> Preset:
    """`model` (a preset name, a config.json path or folder, or a dict) as a `Preset`; a multimodal config gives its text
    model's."""
    if isinstance(model, Preset):
        return model
    if isinstance(model, dict):
        raw, name = model, model.get("_name_or_path") or model.get("model_type", "custom")
    else:
        text = str(model)
        from colo_kit.models import PRESETS

        if text.lower() in PRESETS:
            return PRESETS[text.lower()]
        path = Path(text)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"model {text!r} is neither a preset ({sorted(PRESETS)}) nor an HF config.json "
                             "(file or folder); pass one of those")
        raw, name = _read_config(text, path, file), file.parent.name
    if not isinstance(raw, dict):
        raise ValueError(f"config of {name!r} is a JSON {type(raw).__name__}, not an object: pass a model's config.json")
    config, fields = _text_config(raw, name)
    need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    # the config class fills a missing field with its default (Qwen2's hidden_size is 4096): only the file says
    missing = [k for k in need if k not in fields]
    if missing:
        raise ValueError(f"config of {name!r} lacks {missing}: the planner needs a dense decoder's config.json")
    # AutoConfig may keep a bad type or value (a config class transformers does not know keeps anything)
    shape = {key: getattr(config, key, None) for key in need}
    # a config without num_key_value_heads has one KV head per head (Qwen2Config's default would be 32)
    kv_heads = getattr(config, "num_key_value_heads", None) if "num_key_value_heads" in fields else None
    shape["num_key_value_heads"] = shape["num_attention_heads"] if kv_heads is None else kv_heads
    for key, value in shape.items():
        if type(value) is not int or value < 1:
            raise ValueError(f"config of {name!r}: {key}={value!r} is not a positive whole number")
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    approx = 2 * shape["vocab_size"] * h + shape["num_hidden_layers"] * (4 * h * h + 3 * h * inter)
    if approx > MAX_PARAMS:
        raise ValueError(f"config of {name!r}: hidden_size={h}, intermediate_size={inter} and "
                         f"num_hidden_layers={shape['num_hidden_layers']} make about {approx:.1e} parameters, more "
                         f"than the {MAX_PARAMS:.0e} the planner sizes: check the config's sizes")
    return Preset(str(name), None, shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
                  shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"],
                  bool(getattr(config, "tie_word_embeddings", False)), buildable=False)


def _read_config(text: str, path: Path, file: Path):
    """The config.json's raw fields as `AutoConfig.from_pretrained` reads them, to tell a field the file lacks from a default."""
    from transformers import PreTrainedConfig

    try:
        return PreTrainedConfig.get_config_dict(str(path), local_files_only=True)[0]
    except (OSError, ValueError) as exc:
        # transformers says "not a valid JSON file"; the JSON error it comes from says where
        raise ValueError(f"model {text!r}: {file} is not a readable JSON config ({exc.__context__ or exc})") from None
    except TypeError:
        # transformers' reader fails on any JSON value but an object: read it to say what it is
        return json.loads(file.read_text())


def _text_config(raw: dict, name: str):
    """(the transformers config of the text model, the fields its part of `raw` gives)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig

    model_type = raw.get("model_type")
    try:
        if model_type in CONFIG_MAPPING:
            config = AutoConfig.for_model(**raw)  # raw["model_type"] picks the class
        else:
            # No model_type, or one this transformers does not know: its base config keeps every field.
            config = PreTrainedConfig(**raw)
        text = config.get_text_config()
        if isinstance(text, dict):  # the base config leaves an unknown model's text_config a dict
            return PreTrainedConfig(**text), text
    except (StrictDataclassError, TypeError, ValueError) as exc:  # transformers checks the types of known fields
        reason = " ".join(str(exc).split())
        raise ValueError(f"config of {name!r}: transformers rejects it as a {model_type!r} config ({reason}); "
                         "fix that field or pass a model's config.json") from None
    # the part of the file the text config was built from: a sub-dict (text_config, ...) or the whole file
    fields = next((v for k, v in raw.items() if isinstance(v, dict) and getattr(config, k, None) is text), raw)
    return text, fields
