"""Break-it labs: the posts' pitfalls, run live on the learner's machine, broken and then fixed.

Each function runs the real parts (TRL's trainer, vLLM's engine) twice, once with the pitfall and once
without, and returns one row per run for the notebook to print side by side:

- `top_p_breaks_importance_sampling` (notebook 00): with `top_p < 1` vLLM samples from a truncated,
  renormalised distribution, while the trainer scores the same tokens under its full softmax. TRL's
  importance-sampling correction sees the difference on every token; its sequence-level ratio (a product
  over the completion's tokens) collapses towards 0, and the loss of those sequences with it (TRL #6789).
"""

from __future__ import annotations


def top_p_breaks_importance_sampling(model: str, top_ps=(0.8, 1.0), steps: int = 3, **run_kwargs) -> list[dict]:
    """Train `steps` GRPO steps at each `top_p` with one reused engine; return TRL's importance-sampling logs."""
    from colo_kit.bench import release_engines, reuse_engines
    from colo_kit.train import run_grpo

    from transformers.trainer_callback import PrinterCallback

    def quiet(trainer):  # no progress bar and no per-step dict: the table below is the output
        trainer.remove_callback(PrinterCallback)

    rows = []
    reuse_engines()  # top_p is a sampling setting, not an engine one: both runs share one engine
    try:
        for top_p in top_ps:
            run = run_grpo(model, "colocate", max_steps=steps, num_generations=4, per_device_batch=8,
                           max_completion_length=32, learning_rate=1e-3, top_p=top_p, disable_tqdm=True, on_trainer=quiet,
                           **run_kwargs)
            rows.append({
                "top_p": top_p,
                "IS ratio mean (TRL's log)": run.series("sampling/importance_sampling_ratio/mean")[-1],
                "IS ratio min": run.series("sampling/importance_sampling_ratio/min")[-1],
                "vLLM vs trainer log-prob gap (nats/token)": run.series("sampling/sampling_logp_difference/mean")[-1],
            })
            del run
    finally:
        release_engines()
    return rows
