"""`colo-kit plan`: the memory planner (`colo_kit.planner`) as a command.

    colo-kit plan --model qwen2.5-72b --gpus 8 --zero-stage 3 --sleep-level 2
    colo-kit plan --validate          # measured vs predicted peaks, written under results/runs/
    colo-kit plan --model qwen2.5-1.5b --recommend --out recipe.yaml   # GRPOConfig fields for TrlParser
"""

from __future__ import annotations

import json

from colo_kit.planner import H200_GIB, Plan, plan_report
from colo_kit.planner_validation import write_validation


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


def _write_recipe(plan: Plan, args) -> int:
    from pathlib import Path

    from colo_kit.cli import UsageError, writable_file
    from colo_kit.paths import runs_dir
    from colo_kit.recipe import recipe, to_yaml

    if args.num_generations < 2:
        raise UsageError(f"--num-generations {args.num_generations}: GRPO compares at least 2 completions per prompt")
    if plan.mode != "colocate":
        raise UsageError(f"--mode {plan.mode}: --recommend writes a colocate recipe; drop --mode server")
    r = recipe(plan, num_generations=args.num_generations)
    if not r["fits"]:
        raise UsageError(f"no recipe: {r['why']}")
    name = Path(str(plan.model)).name
    out = writable_file(args.out or runs_dir() / f"recipe_{name}_{plan.gpus}gpu.yaml", "--out")
    text = to_yaml(r)
    out.write_text(text)
    print(text, end="")
    print(f"# predicted peak {r['peak_gib_per_gpu']:.1f} GiB per GPU (modelled); wrote {out}")
    return 0


def cli_main(argv: list[str]) -> int:
    from colo_kit.cli import ArgumentParser, UsageError

    ap = ArgumentParser(prog="colo-kit plan", description="Estimate per-GPU memory of a TRL GRPO step "
                                 "(colocated vLLM or server mode) and recommend settings.")
    ap.add_argument("--model", default="qwen2.5-1.5b", help="preset name or path to an HF config.json / model folder")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--gpu-mem-gib", type=float, default=H200_GIB)
    ap.add_argument("--mode", default="colocate", help="colocate | server (server: the training GPU)")
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--offload-optimizer", action="store_true")
    ap.add_argument("--offload-params", action="store_true")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--vllm-tensor-parallel-size", "--tp", type=int, default=1)
    ap.add_argument("--sleep-level", type=int, default=0, help="0 = no sleep, 1, 2")
    ap.add_argument("--per-device-train-batch-size", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=96)
    ap.add_argument("--max-completion-length", type=int, default=256)
    ap.add_argument("--lora-rank", type=int, default=0, help="0 = full fine-tuning")
    ap.add_argument("--no-gradient-checkpointing", action="store_true", help="TRL's GRPOConfig enables it by default")
    ap.add_argument("--train-dtype", default="float32", help="float32 (TRL default) or bfloat16")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--host-mem-gib", type=float, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--validate", action="store_true",
                    help="compare with the measured peaks and write the table to --out")
    ap.add_argument("--out", default=None, help="--validate's JSON (default results/runs/planner_validation.json; "
                    "the committed results/planner_validation.json changes only when named here) or --recommend's YAML")
    ap.add_argument("--steps-per-generation", type=int, default=1, help="TRL's steps_per_generation")
    ap.add_argument("--num-generations", type=int, default=8, help="G, written into --recommend's recipe")
    ap.add_argument("--recommend", action="store_true",
                    help="write a recipe: GRPOConfig fields in TRL's names, each with why (to --out, default "
                         "results/runs/recipe_<model>_<gpus>gpu.yaml), and print it")
    ap.add_argument("--write-configs", action="store_true",
                    help="also write configs/accelerate/zero3_<model>_<gpus>gpu.yaml, configs/deepspeed/*.json and a DDP "
                         "yaml; a file already there with other contents is kept, the new one written beside it "
                         "(*.proposed.*)")
    ap.add_argument("--replace-configs", action="store_true",
                    help="with --write-configs: replace files that differ instead of writing beside them")
    args = ap.parse_args(argv)
    if args.validate:
        from colo_kit.cli import writable_file
        from colo_kit.paths import runs_dir

        path = write_validation(writable_file(args.out or runs_dir() / "planner_validation.json", "--out"))
        table = json.loads(path.read_text())
        for r in table["rows"]:
            print(f"{r['row']:<44} measured {r['measured_gib']:6.1f}  predicted {r['predicted_gib']:6.1f} GiB  "
                  f"error {r['error']:+.1%}")
        print(f"max |error| {table['max_abs_error']:.1%}; wrote {path}")
        return 0
    plan = Plan(model=args.model, gpus=args.gpus, gpu_mem_gib=args.gpu_mem_gib, mode=args.mode,
                zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer,
                offload_params=args.offload_params, vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                vllm_tensor_parallel_size=args.vllm_tensor_parallel_size, sleep_level=args.sleep_level,
                per_device_train_batch_size=args.per_device_train_batch_size, prompt_length=args.prompt_length,
                max_completion_length=args.max_completion_length, lora_rank=args.lora_rank,
                gradient_checkpointing=not args.no_gradient_checkpointing, train_dtype=args.train_dtype,
                gpus_per_node=args.gpus_per_node, host_mem_gib=args.host_mem_gib,
                steps_per_generation=args.steps_per_generation)
    try:
        report = plan_report(plan)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.recommend:
        return _write_recipe(plan, args)
    if args.write_configs:
        from colo_kit.recipes import write_configs

        offload = report["recommendation"].get("offload_optimizer", args.offload_optimizer) or args.offload_optimizer
        written = write_configs(args.model, args.gpus, offload_optimizer=offload, offload_params=args.offload_params,
                                gpus_per_node=args.gpus_per_node, replace=args.replace_configs)
        report["configs"] = {k: str(v) for k, v in written.items()}
        beside = [str(v) for v in written.values() if ".proposed." in v.name]
        if beside:
            report["notes"].append("kept the configs already there, which differ; the new ones are beside them: "
                                   + ", ".join(beside) + " (--replace-configs replaces them)")
    print(json.dumps(report, indent=1) if args.json else _format(report))
    return 0
