"""Async GRPO with LoRA adapters: notebook 06 (async LoRA behind a proxy).

- async_grpo, lora: TRL's AsyncGRPOTrainer with the post's rank-1 LoRA, adapters published through a shared
  folder and loaded by the replicas
- replicas, replica_auth: vLLM replicas started from a notebook, each asking for a key
- proxy, proxy_cli, proxy_config, proxy_metrics, proxy_replicas, routing: the routing proxy in front of them
  (prefix affinity, adapter broadcast, Prometheus metrics); `colo-kit proxy`
- router_compare: the proxy against vllm-router
"""
