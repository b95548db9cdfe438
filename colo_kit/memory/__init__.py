"""Memory planning and recipes: notebook 04 (the 72B ZeRO-3 recipe).

- planner, model_shapes: per-GPU memory of a GRPO step by part (`colo-kit plan`)
- recipe, recipes: the GRPOConfig YAML `colo-kit plan --recommend` writes, and the accelerate and DeepSpeed
  configs for one node or many
"""
