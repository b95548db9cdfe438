"""GRPO with TRL's GRPOTrainer: what notebook 00 (quickstart) runs and every later notebook reuses.

- train: `run_grpo(model, mode)`, TRL's trainer in colocate, server or plain mode, with a per-step log to plot
- train_checks, train_cli: every setting checked before a model loads; `colo-kit train`, one TrlParser over
  GRPOConfig and the kit's own knobs
- rewards: the length reward and the Math500 reward, in TRL's reward-function signature
- timeline: where a step's time goes (generation, weight push, training), from TRL's own timers
"""
