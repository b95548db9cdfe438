"""`colo-kit train`: `run_grpo` as a command, parsed by TRL's own `TrlParser` into one `GRPOConfig` (`--beta 0.04`,
or `--config recipe.yaml`) and the kit's few knobs (`TrainArgs`), all checked before a model loads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

from colo_kit_cli.commands import UsageError, writable_dir, writable_file
from colo_kit.env import has_cuda
from colo_kit.grpo.train import RUN_DEFAULTS
from colo_kit.grpo.train_checks import (MODES, check_context, check_grpo_fields, check_server_listens, check_settings,
                                        check_train_args, check_yaml_aliases)
from colo_kit.models import resolve_model


@dataclass
class TrainArgs:
    """What `colo-kit train` takes beyond TRL's `GRPOConfig`."""

    model: str = field(default="tiny", metadata={"help": "a preset (tiny, qwen2.5-0.5b, ...), a model folder or a hub id"})
    mode: str = field(default="colocate", metadata={"help": "where vLLM generates", "choices": list(MODES)})
    reward: str = field(default="length", metadata={"help": "the reward", "choices": ["length", "math500"]})
    target_length: int = field(default=20, metadata={"help": "the length reward's target, in characters"})
    bucketed_push: bool = field(default=False, metadata={
        "help": "push the weights in one load_weights call instead of TRL's one per tensor (colo_kit.colocate.bucketed_push)"})
    json: str | None = field(default=None, metadata={"help": "write the per-step log here (checked before training)"})


def run_defaults() -> dict:
    """`run_grpo`'s defaults for `GRPOConfig` fields: the command's too."""
    from trl import GRPOConfig

    fields = GRPOConfig.__dataclass_fields__
    return {k: v for k, v in RUN_DEFAULTS.items() if k in fields and k != "output_dir"}


def _config_apart(args: list[str]) -> list[str]:
    """`--config=X` as `--config X`, the form TrlParser looks for."""
    return [part for t in args for part in (["--config", t[len("--config="):]] if t.startswith("--config=") else [t])]


def parse(argv: list[str]) -> tuple[dict, TrainArgs, list[str]]:
    """(`GRPOConfig` fields as TRL parsed them over the run defaults, the kit's own knobs, the fields given); a bad value or
    an unknown name is a one-line `UsageError`."""
    import yaml
    from trl import GRPOConfig, TrlParser

    args = _config_apart(list(argv))
    if "--config" in args and args.index("--config") == len(args) - 1:
        raise UsageError("--config needs a YAML file of GRPOConfig fields")
    path = args[args.index("--config") + 1] if "--config" in args else None
    if path is not None:
        try:
            check_yaml_aliases(path)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def one_line(message):
        raise UsageError(f"{message} (GRPOConfig fields in TRL's spelling, e.g. --beta 0.04)")

    class Parser(TrlParser):
        """TRL's parser, noting which fields its one read of the --config YAML set."""

        from_config: list[str] = []

        def set_defaults_with_config(self, **kwargs):
            self.from_config = list(kwargs)
            return super().set_defaults_with_config(**kwargs)

    parser = Parser((GRPOConfig, TrainArgs), prog="colo-kit train",
                    description="GRPO with TRL's GRPOTrainer; any GRPOConfig field in TRL's name, or --config "
                                "FILE.yaml of them")
    parser.error = one_line
    parser.set_defaults(**run_defaults())
    base = [] if has_cuda() else ["--use_cpu", "true", "--bf16", "false"]
    on_line = [t[2:].split("=")[0].replace("-", "_") for t in args if t.startswith("--") and t != "--config"]
    try:
        config, kit = parser.parse_args_and_config(base + args)
    except UsageError:  # TRL's parser already said it in one line (one_line above)
        raise
    except (OSError, yaml.YAMLError) as exc:
        why = (f"{exc.problem} at line {exc.problem_mark.line + 1}" if isinstance(exc, yaml.MarkedYAMLError)
               else exc.strerror if isinstance(exc, OSError) else str(exc))
        raise UsageError(f"--config {path!r}: cannot read it as YAML ({why}); give a YAML file of GRPOConfig "
                         "fields") from None
    except ZeroDivisionError:  # GRPOConfig.__post_init__ divides by num_generations before checking it
        ns, _ = parser.parse_known_args(base + args)
        zero = next((n for n in on_line + parser.from_config if getattr(ns, n, None) == 0), "a count")
        raise UsageError(f"{zero}=0: give a whole number of at least 1 (TRL's GRPOConfig divides by it)") from None
    except ValueError as exc:
        first = str(exc).splitlines()[0].rstrip(".")[:300]  # TRL's message may hold a whole YAML value
        if "must contain a YAML mapping" in first:
            raise UsageError(f"--config {path!r}: not a YAML mapping of GRPOConfig fields") from None
        if "not used by the HfArgumentParser" in first:
            raise UsageError(f"{first}: colo-kit train takes GRPOConfig fields in TRL's names and --model, --mode, "
                             "--reward, --target-length, --bucketed-push, --json (see --help)") from None
        raise UsageError(f"{first} (TRL's GRPOConfig refused the settings)") from None
    given = on_line + parser.from_config
    grpo = {name: getattr(config, name) for name in dict.fromkeys(list(run_defaults()) + given)
            if name in GRPOConfig.__dataclass_fields__}
    return {k: v.value if isinstance(v, Enum) else v for k, v in grpo.items()}, kit, given  # e.g. lr_scheduler_type


def main(argv: list[str]) -> int:
    from colo_kit.grpo import train  # looked up at call time: tests stand a recording run_grpo in for it

    grpo, kit, given = parse(argv)
    checked = {k: grpo[k] for k in given if k in grpo}  # as given: their types are checked below
    settings = {k: grpo.pop(k) for k in run_defaults()}  # run_grpo's own keyword arguments, in TRL's names
    overrides = {k: v for k, v in grpo.items() if k in given}  # TRL's parser fills in every field; run_grpo sets most
    output_dir = overrides.pop("output_dir", None)  # TRL's run folder; the kit's own under results/runs/ if not given
    use_vllm, vllm_mode = overrides.pop("use_vllm", None), overrides.pop("vllm_mode", None)
    mode = "plain" if use_vllm is False else vllm_mode or kit.mode
    try:
        check_train_args(kit)
        if kit.target_length < 0:
            raise ValueError(f"target_length={kit.target_length}: give a whole number of at least 0 (characters)")
        check_grpo_fields(checked)
        check_settings(mode, vllm_server_host=overrides.get("vllm_server_host"),
                       **{k: v for k, v in settings.items() if k != "vllm_enable_sleep_mode"})  # a bool: no check
        resolve_model(kit.model, build=False)
        check_context(kit.model, settings["max_completion_length"])
        if mode == "colocate" and settings["vllm_enable_sleep_mode"] and not has_cuda():
            from colo_kit.colocate.sleep import SleepModeUnavailable

            raise SleepModeUnavailable.for_this_platform("vllm_enable_sleep_mode=True")
        if mode == "server":
            check_server_listens(settings["vllm_server_base_url"] or f"http://{overrides['vllm_server_host']}:"
                                 f"{overrides.get('vllm_server_port', 8000)}")
    except (ValueError, LookupError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    if output_dir is not None:
        writable_dir(output_dir, "--output_dir")
    out = writable_file(kit.json, "--json") if kit.json else None
    dataset = None
    if kit.reward == "math500":
        from colo_kit.data import load_math, math_prompt

        dataset = load_math().map(lambda r: {"prompt": math_prompt(r["problem"])})
    run = train.run_grpo(kit.model, mode, reward=kit.reward, dataset=dataset, target_length=kit.target_length,
                         push_bucket_mb=0 if kit.bucketed_push else None, output_dir=output_dir, **settings,
                         **overrides)
    rewards = run.rewards
    print(f"[colo_kit] {mode}: {len(rewards)} steps in {run.elapsed_s} s; reward {rewards[0]:.2f} -> {rewards[-1]:.2f}")
    if out:
        out.write_text(json.dumps(run.to_dict(), indent=1))
    return 0
