"""`colo-kit train`: `run_grpo` (colo_kit.train) as a command. Its own flags, plus any other `GRPOConfig` field in
TRL's spelling (`--beta 0.04`) or a YAML of them (`--config recipe.yaml`, what `colo-kit plan --recommend` writes),
parsed by TRL's own `TrlParser`; everything checked (colo_kit.train_checks) before a model loads."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from colo_kit.env import has_cuda
from colo_kit.train_checks import MODES, check_context, check_grpo_fields, check_settings

# GRPOConfig fields that `colo-kit train` also takes as its own flags (--per-device-batch, --sleep, --server-url set
# per_device_train_batch_size, vllm_enable_sleep_mode, vllm_server_base_url). Given in TRL's spelling (on the command
# line or in a --config YAML such as `colo-kit plan --recommend` writes) they set the same setting, and win.
TRL_NAMES = ("per_device_train_batch_size", "vllm_enable_sleep_mode", "vllm_server_base_url", "max_steps",
             "num_generations", "max_completion_length", "learning_rate", "seed", "vllm_gpu_memory_utilization")


def _config_path(args: list[str]) -> str | None:
    for i, token in enumerate(args):
        if token == "--config":
            return args[i + 1] if i + 1 < len(args) else ""
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def trl_overrides(args: list[str]) -> dict:
    """Any other `GRPOConfig` field, in TRL's own spelling (`--beta 0.04`, `--loss_type dr_grpo`) or
    from a YAML file (`--config recipe.yaml`, as TRL's scripts and alignment-handbook take one),
    parsed and checked by TRL's `TrlParser`. Returns the fields given, with TRL's parsed values;
    a bad one is a `UsageError` naming it."""
    import yaml
    from trl import GRPOConfig, TrlParser

    from colo_kit.cli import UsageError

    given = [t[2:].split("=")[0].replace("-", "_") for t in args if t.startswith("--")]
    path = _config_path(args)
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise UsageError(f"--config {path!r}: cannot read it as YAML ({exc}); give a YAML file of GRPOConfig "
                             "fields") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"--config {path!r}: holds a YAML {type(loaded).__name__}, not a mapping of GRPOConfig "
                             "fields")
        given = [g for g in given if g != "config"] + [k for k in loaded if k != "env"]
        args = [t for t in args if not t.startswith("--config=")] + (
            ["--config", path] if any(t.startswith("--config=") for t in args) else [])
    def one_line(message):
        raise UsageError(f"{message} (GRPOConfig fields in TRL's spelling, e.g. --beta 0.04)")

    parser = TrlParser((GRPOConfig,))
    parser.error = one_line
    base = [] if has_cuda() else ["--use_cpu", "true", "--bf16", "false"]
    try:
        (config,) = parser.parse_args_and_config(base + list(args))
    except UsageError:  # TRL's parser already said it in one line (one_line above)
        raise
    except ValueError as exc:
        first = str(exc).splitlines()[0].rstrip(".")
        if "not used by the HfArgumentParser" in first:  # a name neither the kit nor GRPOConfig knows
            raise UsageError(f"{first}: colo-kit train takes its own flags (--help) and GRPOConfig fields in "
                             "TRL's spelling") from None
        raise UsageError(f"{first} (TRL's GRPOConfig refused the settings)") from None
    values = {name: getattr(config, name) for name in dict.fromkeys(given)}
    return {k: v.value if isinstance(v, Enum) else v for k, v in values.items()}  # e.g. lr_scheduler_type


def cli_main(argv: list[str]) -> int:
    import json

    from colo_kit.cli import (ArgumentParser, UsageError, fraction, nonneg_int, positive_float, positive_int, seed_int,
                              writable_file)
    from colo_kit import train  # looked up at call time: tests stand a recording run_grpo in for it
    from colo_kit.models import PRESETS, resolve_model

    ap = ArgumentParser(prog="colo-kit train", description=train.run_grpo.__doc__,
                        epilog="Any other GRPOConfig field in TRL's spelling (--beta 0.04, --loss_type dr_grpo), "
                               "or --config FILE.yaml of them, is handed to TRL's own parser.")
    ap.add_argument("--model", default="tiny", help=f"a preset ({', '.join(PRESETS)}), a model folder or a hub id")
    ap.add_argument("--mode", default="colocate", choices=MODES)
    ap.add_argument("--reward", default="length", choices=["length", "math500"])
    ap.add_argument("--max-steps", type=positive_int, default=20)
    ap.add_argument("--num-generations", type=positive_int, default=4)
    ap.add_argument("--per-device-batch", dest="per_device_train_batch_size", metavar="PER_DEVICE_BATCH",
                    type=positive_int, default=8)
    ap.add_argument("--max-completion-length", type=positive_int, default=32)
    ap.add_argument("--learning-rate", type=positive_float, default=1e-3)
    ap.add_argument("--target-length", type=nonneg_int, default=20, help="the length reward's target, in characters")
    ap.add_argument("--vllm-gpu-memory-utilization", type=fraction, default=0.3)
    ap.add_argument("--sleep", dest="vllm_enable_sleep_mode", action="store_true",
                    help="vLLM sleep mode between generations (GPU only)")
    ap.add_argument("--server-url", dest="vllm_server_base_url", metavar="SERVER_URL", default=None)
    ap.add_argument("--seed", type=seed_int, default=0)
    ap.add_argument("--bucketed-push", action="store_true",
                    help="push the weights in one load_weights call instead of TRL's one per tensor (colo_kit.bucketed_push)")
    ap.add_argument("--json", default=None, help="write the per-step log here (checked writable before training)")
    a, rest = ap.parse_known_args(argv)
    overrides = trl_overrides(rest) if rest else {}
    given = dict(overrides)  # in TRL's names, as given: checked below, after the kit's flags take theirs
    settings = {name: overrides.pop(name, getattr(a, name)) for name in TRL_NAMES}  # TRL's spelling wins
    output_dir = overrides.pop("output_dir", None)  # TRL's run folder; the kit's own under results/runs/ if not given
    use_vllm, vllm_mode = overrides.pop("use_vllm", None), overrides.pop("vllm_mode", None)
    if use_vllm is False:
        a.mode = "plain"
    elif vllm_mode is not None:
        a.mode = vllm_mode
    try:
        check_grpo_fields(given)
        check_settings(a.mode, vllm_server_host=overrides.get("vllm_server_host"),
                       **{k: v for k, v in settings.items() if k != "vllm_enable_sleep_mode"})  # a bool: no check
        resolve_model(a.model, build=False)
        check_context(a.model, settings["max_completion_length"])
    except (ValueError, LookupError) as exc:
        raise UsageError(str(exc)) from None
    out = writable_file(a.json, "--json") if a.json else None
    dataset = None
    if a.reward == "math500":
        from colo_kit.data import load_math, math_prompt

        dataset = load_math().map(lambda r: {"prompt": math_prompt(r["problem"])})
    run = train.run_grpo(a.model, a.mode, reward=a.reward, dataset=dataset, target_length=a.target_length,
                         push_bucket_mb=0 if a.bucketed_push else None, output_dir=output_dir, **settings, **overrides)
    rewards = run.rewards
    print(f"[colo_kit] {a.mode}: {len(rewards)} steps in {run.elapsed_s} s; reward {rewards[0]:.2f} -> {rewards[-1]:.2f}")
    if out:
        out.write_text(json.dumps(run.to_dict(), indent=1))
    return 0
