"""Async GRPO with LoRA adapters: notebook 06 (async LoRA behind a proxy).

TRL's AsyncGRPOTrainer with the post's rank-1 LoRA, adapters published through a shared folder (async_grpo, lora);
vLLM replicas started from a notebook, each asking for a key (replicas, replica_auth); the routing proxy in front of
them, with prefix affinity and adapter broadcast (proxy*, routing; `colo-kit proxy`).
"""
