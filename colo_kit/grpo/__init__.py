"""GRPO with TRL's GRPOTrainer (notebook 00, reused by every later one): train and its checks (`colo-kit train`), the
rewards, and the timeline of where a step's time goes.
"""
