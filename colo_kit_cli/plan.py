"""`colo-kit plan`: the memory planner (`colo_kit.memory.planner`) as a command.

    colo-kit plan --model qwen2.5-72b --gpus 8 --zero-stage 3 --sleep-level 2
    colo-kit plan --model qwen2.5-1.5b --recommend --out recipe.yaml   # GRPOConfig fields for TrlParser

`--recommend` sizes the recipe for the GPU here (its memory read by NVML) unless --gpu-mem-gib names another.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from colo_kit.memory.planner import H200_GIB, Plan, plan_report


def _format(report: dict) -> str:
    lines = [f"{report['model']} ({report['params_b']}B params), {report['settings']['gpus']} GPU(s), "
             f"{report['settings']['mode']}, ZeRO-{report['settings']['zero_stage']}, sleep level "
             f"{report['settings']['sleep_level']}, u={report['settings']['vllm_gpu_memory_utilization']}"]
    for phase in ("training", "generation"):
        lines.append(f"  {phase} phase: {report['phase_peaks_gib'][phase]:.1f} GiB per GPU")
        for k, v in report["parts"][phase].items():
            if v:
                lines.append(f"    {k:<22} {v:8.2f} GiB")
    host = report["host_gib_per_node"]
    if host["total"]:
        lines.append(f"  host memory per node: {host['total']:.0f} GiB ("
                     + ", ".join(f"{k} {v:.0f}" for k, v in host.items() if v and k != "total") + ")"
                     + ("" if report["fits_host"] else f" > --host-mem-gib {report['settings']['host_mem_gib']}"))
    verdict = "fits" if report["fits"] else ("does NOT fit in host memory" if report["fits_gpu"] else "does NOT fit")
    lines.append(f"  peak {report['peak_gib_per_gpu']:.1f} GiB of {report['settings']['gpu_mem_gib']} GiB "
                 f"({report['peak_phase']} phase): {verdict}")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    rec = report["recommendation"]
    lines.append("  recommendation: " + (json.dumps({k: v for k, v in rec.items() if k != "why"}) if rec["fits"] else ""))
    lines.append(f"    {rec['why']}")
    return "\n".join(lines)


def _gpu_for(plan: Plan, argv: list[str]) -> tuple[Plan, str]:
    """`plan` sized for the GPU here when --gpu-mem-gib is not given (NVML), and a line saying which memory it used."""
    from colo_kit.memory.planner import read_gpu_memory  # looked up at call time: tests stand in for NVML

    if any(t.split("=", 1)[0] in ("--gpu_mem_gib", "--gpu-mem-gib") for t in argv):
        return plan, f"sized for --gpu-mem-gib {plan.gpu_mem_gib:g} GiB per GPU"
    gpu = read_gpu_memory()
    if gpu is None:
        return plan, (f"sized for one H200 ({H200_GIB} GiB): no NVIDIA GPU here, so --gpu-mem-gib sizes it for yours")
    return replace(plan, gpu_mem_gib=gpu["gib"]), (f"sized for the GPU here, {gpu['name']}: {gpu['gib']:g} GiB read by "
                                                   "NVML (--gpu-mem-gib sizes it for another)")


def _write_recipe(plan: Plan, args, gpu_line: str) -> int:
    from colo_kit_cli.commands import UsageError, writable_file
    from colo_kit.paths import runs_dir
    from colo_kit.memory.recipe import recipe, to_yaml

    if args.num_generations < 2:
        raise UsageError(f"--num-generations {args.num_generations}: GRPO compares at least 2 completions per prompt")
    if plan.mode != "colocate":
        raise UsageError(f"--mode {plan.mode}: --recommend writes a colocate recipe; drop --mode server")
    try:
        r = recipe(plan, num_generations=args.num_generations)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not r["fits"]:
        raise UsageError(f"no recipe: {r['why']} ({gpu_line})")
    r["comments"].insert(0, gpu_line)
    name = Path(str(plan.model)).name
    out = writable_file(args.out or runs_dir() / f"recipe_{name}_{plan.gpus}gpu.yaml", "--out")
    text = to_yaml(r)
    out.write_text(text)
    print(text, end="")
    print(f"# predicted peak {r['peak_gib_per_gpu']:.1f} GiB per GPU (modelled); wrote {out}")
    return 0


@dataclass
class PlanCommand:
    """What `colo-kit plan` does with the `Plan` its other flags describe."""

    json: bool = field(default=False, metadata={"help": "print the report as JSON"})
    out: str | None = field(default=None, metadata={"help": "--recommend's YAML"})
    num_generations: int = field(default=8, metadata={"help": "G, written into --recommend's recipe"})
    recommend: bool = field(default=False, metadata={
        "help": "write a recipe: GRPOConfig fields in TRL's names, each with why (to --out, default "
                "results/runs/recipe_<model>_<gpus>gpu.yaml), and print it"})
    write_configs: bool = field(default=False, metadata={
        "help": "also write configs/accelerate/zero3_<model>_<gpus>gpu.yaml, configs/deepspeed/*.json and a DDP yaml; "
                "a file already there with other contents is kept, the new one written beside it (*.proposed.*)"})
    replace_configs: bool = field(default=False, metadata={
        "help": "with --write-configs: replace files that differ instead of writing beside them"})


def main(argv: list[str]) -> int:
    from colo_kit_cli.commands import UsageError, parse_dataclasses

    # every field of the planner's Plan is a flag (--per-device-train-batch-size, --zero-stage, --tp, ...)
    plan, args = parse_dataclasses((Plan, PlanCommand), argv, prog="colo-kit plan", description=(
        "Estimate per-GPU memory of a TRL GRPO step (colocated vLLM or server mode) and recommend settings."))
    try:
        plan.validate()  # a bad number is one line before NVML is read
        gpu_line = ""
        if args.recommend:
            plan, gpu_line = _gpu_for(plan, argv)
        report = plan_report(plan)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.recommend:
        return _write_recipe(plan, args, gpu_line)
    if args.write_configs:
        from colo_kit.memory.recipes import write_configs

        offload = report["recommendation"].get("offload_optimizer", plan.offload_optimizer) or plan.offload_optimizer
        written = write_configs(plan.model, plan.gpus, offload_optimizer=offload, offload_params=plan.offload_params,
                                gpus_per_node=plan.gpus_per_node, replace=args.replace_configs)
        report["configs"] = {k: str(v) for k, v in written.items()}
        beside = [str(v) for v in written.values() if ".proposed." in v.name]
        if beside:
            report["notes"].append("kept the configs already there, which differ; the new ones are beside them: "
                                   + ", ".join(beside) + " (--replace-configs replaces them)")
    print(json.dumps(report, indent=1) if args.json else _format(report))
    return 0
