"""Math500 evaluation (`colo-kit eval-math500`): greedy answers with the training prompt, accuracy with a 95% Wilson
interval. `compare_models` evaluates several models on one engine by pushing each one's weights in: the colocate trick.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from colo_kit.answers.math500 import Checker, default_checker


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion; sane at 0/n and n/n, unlike p ± z·se."""
    if n <= 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _summary(flags: list[bool]) -> dict:
    k, n = sum(flags), len(flags)
    lo, hi = wilson_interval(k, n)
    return {"n": n, "correct": k, "accuracy": k / n if n else 0.0, "ci95": [round(lo, 4), round(hi, 4)]}


def score(problems, completions: list[str], checker: Checker | None = None) -> dict:
    """Score one completion per problem (same order): accuracy, Wilson interval, per subject / level, per problem."""
    rows = [dict(r) for r in problems]
    if len(rows) != len(completions):
        raise ValueError(f"{len(rows)} problems but {len(completions)} completions; pass one completion per problem")
    checker = checker or default_checker()
    samples, t0 = [], time.perf_counter()
    for row, text in zip(rows, completions):
        v = checker.check(text, str(row["answer"]))
        samples.append({"unique_id": row.get("unique_id"), "subject": row.get("subject"), "level": row.get("level"),
                        "gold": row["answer"], "answer": v.answer,
                        "correct": v.correct if v.gold_ok and not v.timed_out else None,
                        "timed_out": v.timed_out, "reason": v.reason, "completion": text})
    scored = [s for s in samples if s["correct"] is not None]
    report = _summary([s["correct"] for s in scored])
    report["checker_timeouts"] = sum(s["timed_out"] for s in samples)  # not scored: no verdict
    report["unparseable_gold"] = len(samples) - len(scored) - report["checker_timeouts"]
    for key in ("subject", "level"):
        groups: dict = {}
        for s in scored:
            if s[key] is not None:
                groups.setdefault(str(s[key]), []).append(s["correct"])
        report[f"by_{key}"] = {g: _summary(v) for g, v in sorted(groups.items())}
    report["score_s"] = round(time.perf_counter() - t0, 3)
    report["samples"] = samples
    return report


def _texts(outputs) -> list[str]:
    """Completion texts from vLLM `RequestOutput`s or from an engine that returns strings."""
    texts = []
    for o in outputs:
        if isinstance(o, str):
            texts.append(o)
        elif hasattr(o, "outputs"):
            texts.append(o.outputs[0].text)
        elif hasattr(o, "text"):
            texts.append(o.text)
        else:
            raise TypeError(f"cannot read a completion from {type(o).__name__}; the engine's generate() should "
                            "return vLLM RequestOutputs or strings")
    return texts


def _engine_model_name(llm) -> str | None:
    try:
        return str(llm.llm_engine.model_config.model)
    except AttributeError:
        return None


def _generate(model, prompts: list[str], *, max_tokens: int, temperature: float, seed: int) -> list[str]:
    """One completion per prompt from a vLLM `LLM` or from the kit's `ColocatedEngine`."""
    import inspect

    params = inspect.signature(model.generate).parameters
    if "sampling_params" in params:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        return _texts(model.generate(prompts, sp, use_tqdm=False) if "use_tqdm" in params
                      else model.generate(prompts, sp))
    out = model.generate(prompts, n=1, max_tokens=max_tokens, temperature=temperature)
    return _texts(out.texts if hasattr(out, "texts") else out)


def evaluate(model, *, limit: int | None = None, source: str = "auto", max_tokens: int = 1024,
             temperature: float = 0.0, seed: int = 0, tokenizer=None, out: str | Path | None = None,
             llm_kwargs: dict | None = None, problems=None) -> dict:
    """Generate one answer per MATH-500 problem with the training prompt and score it. `model`: a vLLM `LLM`, the kit's
    `ColocatedEngine`, or a name / folder for which this starts and stops a vLLM."""
    import colo_kit

    colo_kit.setup()
    from colo_kit.data import load_math, math_prompt
    from colo_kit.env import describe, vllm_version

    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit!r}: evaluate at least one problem (or None for all)")
    if problems is None:
        problems = load_math(source=source)
    dataset_name = getattr(getattr(problems, "info", None), "description", None) or "HuggingFaceH4/MATH-500"
    rows = [dict(r) for r in problems]
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise ValueError(f"no problems to evaluate in {dataset_name}")

    owned = None
    model_name = str(getattr(model, "model_path", None) or _engine_model_name(model) or model)
    if isinstance(model, (str, Path)):
        from vllm import LLM

        from colo_kit.env import has_cuda
        from colo_kit.models import resolve_model

        path = str(resolve_model(str(model)))
        kwargs = {"max_model_len": 2048, "seed": seed, "enforce_eager": not has_cuda()}
        kwargs.update(llm_kwargs or {})
        owned = model = LLM(model=path, **kwargs)
        model_name = path
    if tokenizer is None:
        tokenizer = model.get_tokenizer() if hasattr(model, "get_tokenizer") else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("pass tokenizer=...: the engine has no get_tokenizer() and the chat template is needed "
                         "to build the same prompts as training")
    prompts = [tokenizer.apply_chat_template(math_prompt(r["problem"]), tokenize=False, add_generation_prompt=True)
               for r in rows]
    t0 = time.perf_counter()
    try:
        texts = _generate(model, prompts, max_tokens=max_tokens, temperature=temperature, seed=seed)
    finally:
        generate_s = time.perf_counter() - t0
        if owned is not None:
            from colo_kit.colocate.vllm_compat import shutdown

            shutdown(owned)
    report = score(rows, texts)
    report = {"model": model_name, "dataset": dataset_name, "generate_s": round(generate_s, 3),
              "settings": {"limit": limit, "source": source, "max_tokens": max_tokens, "temperature": temperature,
                           "seed": seed, "prompt": "colo_kit.data.math_prompt"},
              "env": describe(), **report}
    report["env"]["versions"]["vllm"] = vllm_version()
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        report["path"] = str(out)
    return report


def load_policy(engine, model) -> None:
    """Put a model's weights (a transformers model, or a preset / folder / hub id) into a running `ColocatedEngine` or
    vLLM `LLM` (e.g. `trainer.vllm_generation.llm`), so one engine evaluates several models without restarting."""
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM

        from colo_kit.models import resolve_model

        model = AutoModelForCausalLM.from_pretrained(str(resolve_model(str(model))), dtype="auto")
    if hasattr(engine, "push_weights"):
        engine.push_weights(model)
        return
    from colo_kit.colocate.vllm_compat import load_weights

    load_weights(engine, ((name, t.detach()) for name, t in model.state_dict().items()))


def compare_models(engine, models: dict, **evaluate_kwargs) -> dict[str, dict]:
    """`evaluate` each of `models` (name -> model or path) on one engine, loading its weights first."""
    reports = {}
    for name, model in models.items():
        load_policy(engine, model)
        reports[name] = evaluate(engine, **evaluate_kwargs)
    return reports
