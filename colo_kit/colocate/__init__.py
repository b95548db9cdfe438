"""The colocated engine, notebook 02 (sleep mode): vLLM inside the training process, built by TRL's own
VLLMGeneration (engine, engine_build, engine_reuse), timed sleep (sleep), and checks that it samples from the
trainer's weights on a GPU and on vLLM's CPU build (engine_check, vllm_compat). Notebook 04 uses KV-only sleep
(kv_sleep) and the weight push in one load_weights call (bucketed_push).
"""
