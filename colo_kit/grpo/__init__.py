"""GRPO with TRL's GRPOTrainer: what notebook 00 (quickstart) runs and every later notebook reuses.

train (`run_grpo`), train_checks and train_cli (`colo-kit train`, every setting checked before a model loads),
rewards (the length and Math500 rewards) and timeline (where a step's time goes, from TRL's own timers).
"""
