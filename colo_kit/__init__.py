"""colo_kit — teaches and reproduces colocated vLLM generation for GRPO training, one subpackage per notebook: grpo 00,
serving 01 (ping-pong), colocate 02, parallel 03, memory 04, answers 05, async_lora 06, and labs (every exercise); README's
"The package" says what each holds. Shared plumbing at the top (env, models, data, procs, paths, commands; the drivers
notebook and cli); imports only go down these layers."""

from colo_kit.env import quiet  # noqa: F401  (a notebook's first call: colo_kit.quiet(), which calls setup())
from colo_kit.env import setup  # noqa: F401  (the runtime defaults: an explicit call, never an import's side effect)

__version__ = "0.1.0"
