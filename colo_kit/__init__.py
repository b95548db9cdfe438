"""colo_kit — teaches and reproduces colocated vLLM generation for GRPO training. One subpackage per notebook:

  grpo        00  GRPO with TRL's trainer, its rewards and its step timeline
  serving     01  a vLLM server beside the trainers against vLLM inside them (ping-pong)
  colocate    02  the colocated engine: sizing, sleep mode, the weight push
  parallel    03  tensor parallelism and multi-GPU cells launched from a notebook
  memory      04  the memory planner, the recipes it writes, the speed race
  answers     05  the Math500 answer checker and evaluation
  async_lora  06  async GRPO with LoRA adapters behind a routing proxy
  labs        all the exercises and break-it labs
Shared plumbing at the top (env, models, data, procs, paths, results); imports only go down these layers. The
`colo-kit` commands live apart, in colo_kit_cli, which the library never imports.
"""

from colo_kit.env import quiet  # noqa: F401  (a notebook's first call: colo_kit.quiet(), which calls setup())
from colo_kit.env import setup  # noqa: F401  (the runtime defaults: an explicit call, never an import's side effect)

__version__ = "0.1.0"
