"""colo_kit — teaches and reproduces colocated vLLM generation for GRPO training.

Modules, one idea each:
  env       runtime defaults and the machine description every result carries
  models    real architectures with random weights, and a tokenizer made offline
  data      the posts' datasets, with offline stand-ins
  rewards   the length reward and the Math500 reward (TRL's reward-function signature)
  math500   the answer checker (math-verify) and the evaluation runner
  train     GRPO runs with TRL, server or colocate, that the notebooks share
"""

from colo_kit.env import quiet  # noqa: F401  (a notebook's first call: colo_kit.quiet(), which calls setup())
from colo_kit.env import setup  # noqa: F401  (the runtime defaults: an explicit call, never an import's side effect)

__version__ = "0.1.0"
