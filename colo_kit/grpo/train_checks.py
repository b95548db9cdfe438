"""Settings checked before anything is built: what `colo-kit train` and `run_grpo` refuse, in one line naming the bad
value and the fix, instead of failing 10-30 s later inside TRL or vLLM (notebook 00)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import reprlib
import socket
import types
import typing
from pathlib import Path
from urllib.parse import urlsplit

from colo_kit.models import PRESETS

MODES = ("colocate", "server", "plain")
MAX_PER_DEVICE_BATCH = 65536  # completions per device per step; the planner's recipes use 8-256
MAX_SEED = 2**32 - 1  # numpy's seed range: TRL's set_seed seeds numpy too
NO_CONFIG_MAX_POSITIONS = 1_048_576  # a completion-length bound when the model's config cannot be read offline
MAX_YAML_ALIASES = 16  # `*name` repeats a whole value: 9 levels of 9 make 9**9 elements from 400 bytes


def shown(value, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: an error message never formats a whole huge value."""
    short = reprlib.Repr()
    short.maxlist = short.maxtuple = short.maxdict = 8
    short.maxstring = short.maxother = limit
    return short.repr(value)[:limit]


def check_yaml_aliases(path) -> None:
    """Refuse a YAML file with more than a few aliases, counted in its event stream before anything is built."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            count = 0
            for event in yaml.parse(f, Loader=yaml.SafeLoader):
                count += isinstance(event, yaml.AliasEvent)
                if count > MAX_YAML_ALIASES:
                    raise ValueError(f"--config {str(path)!r}: more than {MAX_YAML_ALIASES} YAML aliases (*name), each "
                                     "a copy of a whole value; write the values out")
    except (OSError, UnicodeError, yaml.YAMLError):
        return  # the parser reads it next and says what is wrong


def check_settings(mode: str, *, max_steps: int, num_generations: int, per_device_train_batch_size: int,
                   vllm_gpu_memory_utilization: float, vllm_server_base_url: str | None = None,
                   vllm_server_host: str | None = None,
                   max_completion_length: int | None = None, learning_rate: float | None = None,
                   seed: int | None = None) -> None:
    """Raise ValueError naming the bad value and the fix; the keywords are GRPOConfig fields, None ones unchecked."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    for name, value, least in (("max_steps", max_steps, 1), ("num_generations", num_generations, 2),
                               ("per_device_train_batch_size", per_device_train_batch_size, 1),
                               ("max_completion_length", 1 if max_completion_length is None else max_completion_length, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            why = " (GRPO compares completions of one prompt with each other)" if name == "num_generations" else ""
            raise ValueError(f"{name}={value!r}: give a whole number of at least {least}{why}")
    batch = per_device_train_batch_size
    if batch > MAX_PER_DEVICE_BATCH:
        tokens = f" x max_completion_length {max_completion_length} = {batch * max_completion_length:.3g} " \
                 "tokens" if max_completion_length else ""
        raise ValueError(f"per_device_train_batch_size={batch}: more than {MAX_PER_DEVICE_BATCH} completions per device "
                         f"per step{tokens}, whose activations no GPU holds; give at most {MAX_PER_DEVICE_BATCH} "
                         "(colo-kit plan sizes a batch)")
    if batch % num_generations:
        raise ValueError(f"per_device_train_batch_size={batch} must be a multiple of num_generations="
                         f"{num_generations}: GRPO compares the completions of one prompt with each other")
    if not isinstance(vllm_gpu_memory_utilization, (int, float)) or not 0 < vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"vllm_gpu_memory_utilization={vllm_gpu_memory_utilization}; it is a fraction in (0, 1]")
    if learning_rate is not None and (not isinstance(learning_rate, (int, float)) or isinstance(learning_rate, bool)
                                      or not math.isfinite(learning_rate) or learning_rate <= 0):
        raise ValueError(f"learning_rate={learning_rate!r}: give a finite number above 0, e.g. 1e-3")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed={seed!r}: give a whole number from 0 to {MAX_SEED} (numpy's seed range, which "
                         "TRL's set_seed uses)")
    if vllm_server_base_url is not None:
        check_server_url(vllm_server_base_url)
    # TRL takes the server as a base URL or as host and port; without either it waits 240 s for 0.0.0.0:8000
    if mode == "server" and not (vllm_server_base_url or vllm_server_host):
        raise ValueError("mode='server' needs vllm_server_base_url, or vllm_server_host and vllm_server_port "
                         "(start a server with colo_kit.serving.server)")


def check_server_url(url) -> None:
    """An http(s) URL with a host and a valid port: anything else TRL refuses only after its 240 s wait."""
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        ok = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
        ok = ok and (parts.port is None or parts.port > 0)  # .port raises ValueError past 65535
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"vllm_server_base_url={url!r}: give an http(s) URL with a host, e.g. http://127.0.0.1:8000 "
                         "(colo_kit.serving.server starts a server)")


def check_server_listens(url: str, timeout_s: float = 3.0) -> None:
    """Something accepts connections at `url`'s host and port: else TRL waits 240 s after the model loads."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(f"vllm server {url!r}: nothing answers at {parts.hostname}:{port} ({exc.strerror or exc}); "
                         "start it first (colo_kit.serving.server.start_server) or fix the address") from None


def check_train_args(kit) -> None:
    """The kit's own settings, from flags or a YAML (which TRL's parser hands on unchecked): types, choices, a model folder."""
    kinds = typing.get_type_hints(type(kit))
    for f in dataclasses.fields(kit):
        value, choices = getattr(kit, f.name), f.metadata.get("choices")
        if _fits(value, kinds[f.name]) is False or (choices and value not in choices):
            want = f"one of {', '.join(choices)}" if choices else _kind_name(kinds[f.name])
            raise ValueError(f"{f.name}={shown(value)}: give {want}")
    if os.path.isdir(str(kit.model)) and not os.path.isfile(os.path.join(str(kit.model), "config.json")):
        raise ValueError(f"model={str(kit.model)!r}: a folder without a config.json; give a preset, a folder saved by "
                         "save_pretrained or a hub id")


def model_max_positions(model: str) -> int | None:
    """The model's `max_position_embeddings` when its config can be read without a download; None otherwise."""
    model = str(model)
    config = None
    if os.path.isdir(model):
        config = Path(model) / "config.json"
    elif model.lower() in PRESETS:
        return PRESETS[model.lower()].max_position_embeddings
    elif "/" in model:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a valid hub id: resolve_model has said what it is
            cached = None
        config = Path(cached) if isinstance(cached, str) else None
    try:
        loaded = json.loads(config.read_text()) if config is not None else {}
    except (OSError, ValueError):
        return None
    loaded = loaded.get("text_config", loaded) if isinstance(loaded, dict) else {}
    value = loaded.get("max_position_embeddings") if isinstance(loaded, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def check_context(model: str, max_completion_length: int | None) -> None:
    """A completion longer than the model's context fails inside vLLM, after the model loads."""
    if max_completion_length is None:  # GRPOConfig's None: as long as the engine allows
        return
    limit = model_max_positions(model)
    if limit is None:
        if max_completion_length > NO_CONFIG_MAX_POSITIONS:
            raise ValueError(f"max_completion_length={max_completion_length}: above {NO_CONFIG_MAX_POSITIONS} tokens, "
                             f"longer than any model's context; give at most the model's max_position_embeddings")
    elif max_completion_length > limit:
        raise ValueError(f"max_completion_length={max_completion_length}: longer than {model}'s context "
                         f"(max_position_embeddings={limit}); give at most {limit}")


def _fits(value, kind) -> bool | None:
    """Whether `value` is of the GRPOConfig field type `kind`; None for a type this check does not know."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            return True
        results = [_fits(value, a) for a in args if a is not type(None)]
        return True if True in results else None if None in results else False
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return None


def _kind_name(kind) -> str:
    return str(kind).replace("<class '", "").replace("'>", "").replace("NoneType", "None")


def loss_types() -> tuple[str, ...]:
    """The loss_type values TRL implements, read from its GRPOConfig help; empty if that help changes."""
    from trl import GRPOConfig

    help_ = next(f.metadata.get("help", "") for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type")
    supported = help_.split("Supported values are", 1)[1].split(". ", 1)[0] if "Supported values are" in help_ else ""
    return tuple(re.findall(r"'(\w+)'", supported))


def check_grpo_fields(fields: dict) -> None:
    """Raise ValueError naming a GRPOConfig field TRL would fail on only once the model is loaded: a wrong type (TrlParser
    hands a YAML's values on unconverted), an unknown loss_type, a bad temperature or beta."""
    from trl import GRPOConfig

    kinds = typing.get_type_hints(GRPOConfig)  # not the fields' .type, which HfArgumentParser rewrites in place
    for name, value in fields.items():
        if name in kinds and _fits(value, kinds[name]) is False:
            raise ValueError(f"{name}={shown(value)}: GRPOConfig's {name} is {_kind_name(kinds[name])}, "
                             f"not {type(value).__name__}; give one (--{name} or '{name}:' in the --config YAML)")
    if "loss_type" in fields and (known := loss_types()) and fields["loss_type"] not in known:
        raise ValueError(f"loss_type={fields['loss_type']!r}: TRL implements {', '.join(known)}; choose one")
    temperature, beta = fields.get("temperature"), fields.get("beta")
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature!r}: give a finite number above 0 (TRL divides the logits by it; "
                         "1.0, TRL's default, samples the model as it is)")
    if beta is not None and not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta={beta!r}: the KL coefficient is a finite number of at least 0 (0.0, TRL's default, "
                         "loads no reference model)")
