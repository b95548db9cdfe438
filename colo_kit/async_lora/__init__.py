"""Async GRPO with LoRA adapters (notebook 06): TRL's AsyncGRPOTrainer (async_grpo, lora), vLLM replicas that ask for
a key (replicas, replica_auth), and the routing proxy in front of them (proxy*, routing; `colo-kit proxy`).
"""
