"""`colo-kit eval-math500`: `colo_kit.answers.math500_eval.evaluate` as a command; prints accuracy by subject."""

from __future__ import annotations

from dataclasses import dataclass, field

from colo_kit.answers.math500_eval import evaluate
from colo_kit.data import load_problems
from colo_kit.env import gpu_count
from colo_kit.models import PRESETS, resolve_model
from colo_kit.paths import runs_dir
from colo_kit_cli.commands import UsageError, parse_dataclasses, writable_file


@dataclass
class EvalArgs:
    """`colo-kit eval-math500`'s settings: `evaluate`'s arguments, and where the model and problems come from."""

    model: str = field(default="tiny", metadata={"help": "preset (tiny, qwen2.5-1.5b...), hub id or folder"})
    limit: int | None = field(default=None, metadata={"help": "first N problems only"})
    source: str = field(default="auto", metadata={"help": "where MATH-500 comes from", "choices": ["auto", "hub", "offline"]})
    data: str | None = field(default=None, metadata={"help": "a JSONL file of your own problems (problem, answer) instead"})
    max_tokens: int = field(default=1024, metadata={"help": "tokens per answer"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM's LLM(tensor_parallel_size=...): GPUs"})
    out: str | None = field(default=None, metadata={"help": "JSON path (default results/runs/math500_eval.json)"})


def _check_tp(tp: int, model: str) -> None:
    """vLLM's tensor_parallel_size checked against the GPUs now, not after its engine starts."""
    gpus = gpu_count()
    if not gpus:
        raise UsageError(f"--tensor-parallel-size {tp}: the CPU tier runs the evaluation with TP 1 (one vLLM process on the "
                         "cores); drop --tensor-parallel-size, or use it on a GPU machine")
    if tp > gpus:
        raise UsageError(f"--tensor-parallel-size {tp}: only {gpus} GPU(s) visible; give --tensor-parallel-size {gpus} or "
                         "less")
    preset = PRESETS.get(str(model).lower())
    if preset is not None and preset.num_attention_heads % tp:
        raise UsageError(f"--tensor-parallel-size {tp}: {preset.name}'s {preset.num_attention_heads} attention heads do not "
                         f"split evenly over {tp} GPUs; give a --tensor-parallel-size that divides {preset.num_attention_heads}")


def main(argv: list[str]) -> int:
    (args,) = parse_dataclasses((EvalArgs,), argv, prog="colo-kit eval-math500", description="Evaluate a model on "
                                "MATH-500 (greedy, the training prompt) and write accuracy with a 95%% Wilson interval as JSON.")
    for flag, value in (("--limit", args.limit), ("--max-tokens", args.max_tokens),
                        ("--tensor-parallel-size", args.tensor_parallel_size)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: give a whole number of at least 1")
    if args.tensor_parallel_size > 1:
        _check_tp(args.tensor_parallel_size, args.model)
    out = writable_file(args.out or runs_dir() / "math500_eval.json", "--out")
    try:
        resolve_model(args.model, build=False)
        problems = None
        if args.data:
            problems = load_problems(args.data)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    llm_kwargs = {"tensor_parallel_size": args.tensor_parallel_size} if args.tensor_parallel_size > 1 else None
    r = evaluate(args.model, limit=args.limit, source=args.source, max_tokens=args.max_tokens, out=out,
                 llm_kwargs=llm_kwargs, problems=problems)
    lo, hi = r["ci95"]
    print(f"{r['model']}: {r['correct']}/{r['n']} = {r['accuracy']:.3f} (95% CI {lo:.3f}-{hi:.3f}) on {r['dataset']}")
    for subject, s in r["by_subject"].items():
        print(f"  {subject:<24} {s['correct']:>4}/{s['n']:<4} {s['accuracy']:.3f}")
    print(f"wrote {r['path']}")
    return 0
