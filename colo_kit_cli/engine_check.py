"""The colocated engine across processes: `torchrun --nproc_per_node 2 -m colo_kit_cli.engine_check
--vllm-tensor-parallel-size 2 [--sampled] [--push]` prints one JSON line per rank; at TP 2 both ranks are one model.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings

PROG = "python -m colo_kit_cli.engine_check"


@dataclass
class CheckArgs:
    """The check's settings, in TRL's GRPOConfig names where TRL has the setting."""

    model: str = field(default="tiny", metadata={"help": "a preset, a model folder or a hub id"})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per vLLM engine"})
    max_completion_length: int = field(default=8, metadata={"help": "tokens per completion"})
    sampled: bool = field(default=False, metadata={"help": "also sample at temperature 1 with the TP seed"})
    push: bool = field(default=False, metadata={"help": "also push the model's own weights, then perturbed ones"})
    out_dir: str | None = field(default=None, metadata={
        "help": "write rank<N>.json here too (stdout lines of ranks can interleave)"})


def main(argv: list[str]) -> int:
    """Build an engine in every process, generate, and print one JSON line per rank (the TP=2 test compares them)."""
    from colo_kit_cli.commands import parse_dataclasses

    (args,) = parse_dataclasses((CheckArgs,), argv, prog=PROG, description=__doc__)
    s = ColocateSettings(vllm_tensor_parallel_size=args.vllm_tensor_parallel_size, per_device_train_batch_size=2,
                         max_prompt_length=64, max_completion_length=args.max_completion_length)
    engine = ColocatedEngine(args.model, s)
    prompts = [f"rank {engine.rank} prompt {i}:" for i in range(2)]
    greedy = engine.generate(prompts, max_tokens=args.max_completion_length, temperature=0.0, ignore_eos=True)
    rec = {"rank": engine.rank, "seed": engine.seed, "tp": engine.tp, "prompts": prompts,
           "prompt_texts": [engine.tokenizer.decode(ids) for ids in greedy.prompt_ids],
           "greedy": greedy.completion_ids}
    if args.sampled:
        group = engine.generate(prompts, max_tokens=args.max_completion_length, temperature=1.0, ignore_eos=True,
                                whole_group=True)
        rec["group_sampled"] = group.completion_ids
    if args.push:  # each rank loads the full weights; load_weights keeps this rank's TP shard
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.bfloat16)
        before = engine.probe()
        engine.push_weights(model)
        rec["push_same_probe"] = engine.probe() == before
        torch.manual_seed(0)  # the same perturbation on every rank: they are one model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.push_weights(model)
        rec["push_perturbed_probe"] = engine.probe()["token_ids"]
        rec["probe"] = before["token_ids"]
    print("COLO_KIT_ENGINE " + json.dumps(rec), flush=True)
    if args.out_dir:
        Path(args.out_dir, f"rank{engine.rank}.json").write_text(json.dumps(rec))
    engine.close()
    return 0


if __name__ == "__main__":
    import colo_kit
    from colo_kit_cli.commands import run

    colo_kit.setup()
    raise SystemExit(run(main, sys.argv[1:], PROG))
