"""The colocated engine, notebook 02: vLLM inside the training process, built by TRL's own VLLMGeneration (engine,
engine_build, engine_reuse), timed sleep (sleep), the weight load on a GPU and a CPU (vllm_compat).
KV-only sleep (kv_sleep) and the bucketed push (bucketed_push) are speed-race configurations (record/speed.py, notebook 04).
"""
