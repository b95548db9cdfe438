"""`colo-kit bench --batches 8,32 --modes server,colocate`: `colo_kit.serving.bench.sweep` as a command, its settings
checked before the first run starts."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from colo_kit_cli.commands import UsageError, parse_dataclasses, writable_file
from colo_kit.env import has_cuda
from colo_kit.grpo.train_checks import check_settings
from colo_kit.models import resolve_model
from colo_kit.paths import runs_dir
from colo_kit.serving.bench import sweep, write_plots


def _check_overrides(extra: dict, error) -> None:
    """Each variant's options are `GRPOConfig` fields or `run_grpo` options: a misspelt one would fail minutes into the
    sweep, or be measured as the default."""
    from trl import GRPOConfig

    from colo_kit.grpo.train import run_grpo

    known = {f.name for f in dataclasses.fields(GRPOConfig)} | set(inspect.signature(run_grpo).parameters)
    for label, options in extra.items():
        if unknown := sorted(set(options) - known):
            raise error(f"--extra-colocate {label!r}: {unknown} are neither GRPOConfig fields nor run_grpo options; "
                        "use TRL's spelling, e.g. steps_per_generation")


@dataclass
class BenchArgs:
    """`colo-kit bench`'s settings: `sweep`'s arguments, in TRL's names where TRL has the setting."""

    model: str = field(default="tiny", metadata={"help": "a preset, a model folder or a hub id"})
    batches: str = field(default="4,8", metadata={"help": "per-device batch sizes, comma separated"})
    max_steps: int = field(default=4, metadata={"help": "GRPO steps per config; the first is discarded as warm-up"})
    num_generations: int = field(default=4, metadata={"help": "G, completions per prompt"})
    max_completion_length: int = field(default=32, metadata={"help": "tokens per completion"})
    n_devices: int | None = field(default=None, metadata={"help": "devices to use (default: all)"})
    server_gpus: str = field(default="1", metadata={"help": "server mode: how many devices serve"})
    port: int = field(default=8000, metadata={"help": "the vLLM server's port"})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM's share of each device"})
    gen_probe: str = field(default="", metadata={"help": "generation-only batch sizes timed on the server"})
    modes: str = field(default="server,colocate", metadata={"help": "server, colocate, or both (comma separated)"})
    extra_colocate: str = field(default="{}", metadata={
        "help": 'JSON {label: GRPO overrides} run in colocate mode at the largest batch, e.g. '
                '\'{"colocate-kit-best": {"steps_per_generation": 4}}\''})
    out: str | None = field(default=None, metadata={
        "help": "JSON path (default results/runs/pingpong_<tier>.json; the committed results/pingpong_<tier>.json "
                "changes only when named here)"})
    budget_s: float | None = field(default=None, metadata={"help": "wall-clock budget for the whole sweep"})


def _check_ranges(a: BenchArgs, error) -> None:
    """What neither the field types nor the kit's GRPO checks (`check_settings`, in main) say."""
    if a.n_devices is not None and a.n_devices < 1:
        raise error(f"--n-devices {a.n_devices}: give a whole number of at least 1")
    if not 1 <= a.port <= 65535:
        raise error(f"--port {a.port}: give a TCP port from 1 to 65535")
    if a.budget_s is not None and not (math.isfinite(a.budget_s) and a.budget_s > 0):
        raise error(f"--budget-s {a.budget_s}: give a finite number of seconds above 0")


def main(argv: list[str]) -> int:
    (a,) = parse_dataclasses((BenchArgs,), argv, prog="colo-kit bench", description=sweep.__doc__)
    _check_ranges(a, UsageError)
    try:
        batches = [int(x) for x in a.batches.split(",") if x]
        probe = [int(x) for x in a.gen_probe.split(",") if x]
        if not batches or min(batches + probe + [1]) < 1:
            raise ValueError
    except ValueError:
        raise UsageError(f"--batches {a.batches!r} / --gen-probe {a.gen_probe!r}: use positive integers like 8,32,64")
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    if not modes or set(modes) - {"server", "colocate"}:
        raise UsageError(f"--modes {a.modes!r}: choose server, colocate, or server,colocate")
    if a.max_steps < 2:
        raise UsageError(f"--max-steps {a.max_steps}: at least 2 (the first step is warm-up and not measured)")
    try:  # G, completion length, memory share, each batch a multiple of G: the checks `colo-kit train` makes too
        for b in batches:
            check_settings("colocate", max_steps=a.max_steps, num_generations=a.num_generations,
                           per_device_train_batch_size=b, vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                           max_completion_length=a.max_completion_length)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        extra = json.loads(a.extra_colocate)
        assert isinstance(extra, dict) and all(isinstance(v, dict) for v in extra.values())
    except (ValueError, AssertionError):
        raise UsageError(f"--extra-colocate {a.extra_colocate!r}: give a JSON object of {{label: {{option: value}}}}")
    if extra:
        _check_overrides(extra, UsageError)
    try:  # every run would fail on it, one after the other, and the summary then on none having run
        resolve_model(a.model, build=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out = writable_file(a.out or runs_dir() / f"pingpong_{'gpu' if has_cuda() else 'cpu'}.json", "--out")
    res = sweep(a.model, batches=batches, max_steps=a.max_steps, num_generations=a.num_generations,
                max_completion_length=a.max_completion_length, n_devices=a.n_devices, server_gpus=a.server_gpus,
                server_port=a.port, vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                gen_probe_batches=probe, out=out, modes=modes, extra_colocate=extra, budget_s=a.budget_s)
    for r in res["summary"]:
        print(json.dumps(r))
    html = write_plots(res, runs_dir() / (Path(out).stem + ".html"))
    print(f"[colo_kit] plots: {html}")
    errors = [r for r in res["runs"] if "error" in r]
    print(f"[colo_kit] wrote {out}; {len(res['runs'])} runs, {len(errors)} failed")
    return 1 if errors else 0

