"""Memory planning and recipes: notebook 04 (the 72B ZeRO-3 recipe).

- planner, planner_cli, planner_validation, model_shapes: per-GPU memory of a GRPO step by part, checked
  against measured peaks; `colo-kit plan`
- recipe, recipes: the GRPOConfig YAML `colo-kit plan --recommend` writes, and the accelerate and DeepSpeed
  configs for one node or many
- speed, race: TRL's defaults against the kit's knobs on one GPU (speed runs them), and who reached the same
  reward first (race judges the records)
"""
