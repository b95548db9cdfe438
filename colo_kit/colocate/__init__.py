"""The colocated engine, notebook 02 (sleep mode): vLLM inside the training process, built by TRL's own
VLLMGeneration (engine, engine_build, engine_reuse), timed sleep (sleep), the weight load on a GPU and on vLLM's CPU
build (vllm_compat, engine_check). KV-only sleep (kv_sleep) and the bucketed push (bucketed_push) are configurations
of the speed race (record/speed.py), whose recorded results notebook 04 shows.
"""
