"""The colocated engine: notebook 02 (sleep mode).

- engine, engine_build, engine_reuse: vLLM inside the training process, built by TRL's own VLLMGeneration and
  sized from the training settings
- sleep, kv_sleep: vLLM's sleep levels, timed part by part, and sleep that releases only the KV cache
- bucketed_push: the weight push in one load_weights call instead of one per tensor
- engine_check, vllm_compat: the checks that the engine samples from the trainer's weights, on a GPU and on
  vLLM's CPU build
"""
