"""The launch lines of N vLLM replicas that serve a model plus runtime-loaded LoRA adapters, one per GPU, and the
adapter slots and rank they need (`colo_kit.async_lora.lora.replica_launch`):

    python scripts/lora_replicas.py Qwen/Qwen2.5-1.5B-Instruct --replicas 2 --max_staleness 4
"""

import json
import sys
from dataclasses import dataclass, field

from colo_kit.async_lora.lora import max_lora_rank_for, max_loras_for, replica_launch
from colo_kit_cli.commands import UsageError, parse_dataclasses, run

PROG = "python scripts/lora_replicas.py"


@dataclass
class RecipeArgs:
    """The flags, named as `replica_launch`'s arguments."""

    replicas: int = field(default=2, metadata={"help": "replicas, one per GPU"})
    base_port: int = field(default=8001, metadata={"help": "the first replica's port; the next ones count up"})
    max_staleness: int = field(default=4, metadata={"help": "versions a rollout may lag behind (sets --max-loras)"})
    lora_rank: int = field(default=1, metadata={"help": "the adapter's rank (sets --max-lora-rank)"})


def main(argv: list[str]) -> int:
    # HfArgumentParser takes flags only: the model, a leading word, is taken off first
    model, argv = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else (None, argv)
    (a,) = parse_dataclasses((RecipeArgs,), argv, prog=PROG, description="model (a first word, before the flags): "
                             "a model folder or hub id. Prints each replica's launch line and the slots they need.")
    if model is None:
        raise UsageError(f"no model: give one first, e.g. {PROG} Qwen/Qwen2.5-1.5B-Instruct --replicas 2")
    for i in range(a.replicas):
        print(replica_launch(model, port=a.base_port + i, gpu=i, max_staleness=a.max_staleness,
                             lora_rank=a.lora_rank).shell())
    print(json.dumps({"max_loras": max_loras_for(a.max_staleness), "max_lora_rank": max_lora_rank_for(a.lora_rank)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main, sys.argv[1:], PROG))
