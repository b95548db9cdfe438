"""TRL's `AsyncGRPOTrainer` with a LoRA adapter, against a server URL (the routing proxy), as post 2
runs it: `run_async_grpo(...)`. And what it takes on a machine without FlashAttention-3 (a CPU, or a
GPU node with no access to the Hub): `cpu_async_grpo_patches`, which replaces exactly what stops it.
On a shared machine, where the proxy asks its clients for a token (`--client-token-env`), TRL's
clients, which send none, are made to send it by `trl_client_auth`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from colo_kit.async_lora.lora import published_versions


class TorchVarlenAttention:
    """`flash_attn_varlen_func` in plain PyTorch: the CPU stand-in for the FlashAttention-3 kernel
    that AsyncGRPOTrainer's tree attention fetches from the Hub (`kernels-community/flash-attn3`,
    CUDA only). Each packed segment attends causally to its root-to-segment path (bottom-right
    aligned, as FA does when there are more keys than queries). Slow, exact, enough for a tiny model."""

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
    """Make TRL 1.16's AsyncGRPOTrainer run on a CPU, for the duration of a `with` block. What stops
    it, exactly:

    1. its policy uses `attn_implementation="tree_fa3"`, whose kernel `packing._flash_attn()` fetches
       the FlashAttention-3 CUDA kernel through the `kernels` package (absent here, and no network):
       replaced by `TorchVarlenAttention`;
    2. `get_peak_flops_per_device` calls `torch.cuda.get_device_name` unconditionally (for MFU
       metrics): replaced by "unknown" (None), which TRL handles by skipping MFU;
    3. the rollout worker needs a response template for the chat template; the kit's tiny
       tokenizer carries a reduced Qwen2 template TRL does not recognise, so it is given the one
       TRL uses for Qwen2.5 (only used to parse tool calls). That changes the run's own tokenizer
       object, nothing process-wide.

    Yields what was patched; TRL's functions are its own again when the block ends. The trainer
    itself, its rollout worker, the adapter publishing and the weight-sync calls are TRL's, unchanged."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

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


class BearerRequests:
    """TRL 1.16's async-GRPO `VLLMClient` HTTP client, the `requests` module that
    trl/experimental/async_grpo/vllm_client.py imported (`requests_module`), with `Authorization:
    Bearer <token>` on every call (`requests.get`, `requests.post`). Everything else
    (`requests.ConnectionError`, ...) is that module's own, so TRL's `except` clauses and callers'
    still catch what they did. The kit's own synchronous clients use httpx; this one is TRL's."""

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
    """TRL's rollout loop (`loop_cls`, built with TRL's own arguments) whose generation requests carry
    `Authorization: Bearer $token_env`. It runs in the rollout worker's spawned child, which reads the
    token from its environment (inherited from the trainer's): nothing secret is pickled. TRL makes
    the loop's aiohttp session in `_run_loops` without headers and calls it from `_post` only
    (trl/experimental/async_grpo/async_rollout_worker.py), so `_post` puts the header on that session."""
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
    """Make TRL 1.16's AsyncGRPOTrainer send `Authorization: Bearer <token>` (the value of the
    environment variable `token_env`, the proxy's `--client-token-env`) to its vLLM server, for the
    duration of a `with` block; TRL's clients send no credentials and get 401 from such a proxy.
    Two clients talk to the server, and both are covered:

    1. the trainer's `VLLMClient` (health, `/server_info`, pause, resume, adapter loads) calls the
       `requests` module of trl/experimental/async_grpo/vllm_client.py: that name is `BearerRequests`
       within the block;
    2. the rollout worker (TRL's default `AsyncRolloutWorker`) generates from a spawned child process
       on an aiohttp session: its loop class (`_loop_cls`, pickled by reference into the child) is
       wrapped by `bearer_rollout_loop`.

    TRL's own objects are back when the block ends, even on an error. Build and train the trainer
    inside the block (the worker is spawned by `train()`)."""
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
    """While TRL's `AsyncRolloutWorker.stop` waits for its child, read what the child still sends.

    When training reaches `max_steps` the trainer stops reading the rollout and metrics queues, but the child has
    already put samples there. A process that put items on a `multiprocessing.Queue` flushes them into the pipe
    before it exits (Python's "joining processes that use queues"), so with the pipe full it cannot exit: TRL's
    `stop` waits 15 s, warns "Child did not exit within 15s" and terminates it. Reading the two queues while
    `stop` waits lets the child exit at once; what is read was never going to be trained on. TRL's `stop` is back
    when the block ends."""
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
    """A toy reward (module level, so TRL's spawned rollout worker can import it): the share of a
    completion's words that appear in its prompt. It varies between samples of a random-weight
    model, unlike the length reward (random weights never stop before max_tokens)."""
    out = []
    for i, c in enumerate(completions):
        text = c[-1]["content"] if isinstance(c, list) else str(c)
        p = prompts[i] if prompts is not None else ""
        p = " ".join(m["content"] for m in p) if isinstance(p, list) else str(p)
        words, seen = text.split(), set(p.split())
        out.append(sum(w in seen for w in words) / max(1, len(words)))
    return out


def _bar_without_log_lines(trainer) -> None:
    """Outside a notebook front end, transformers' ProgressCallback writes every step's log dict
    (some 60 metrics here) under its bar: in a cell that buries the table the caller shows. The
    bar stays; the numbers stay in `trainer.state.log_history`."""
    from transformers.trainer_callback import ProgressCallback

    class BarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(BarOnly())


def run_async_grpo(vllm_server_base_url: str, model: str, output_dir: str | os.PathLike, *, prompts: list[str],
                   max_steps: int = 3, num_generations: int = 4, per_device_train_batch_size: int = 8,
                   max_completion_length: int = 16, max_staleness: int = 1, learning_rate: float = 4e-5,
                   lora_rank: int = 1, lora_alpha: int = 2, client_token_env: str | None = None, **config) -> dict:
    """TRL's AsyncGRPOTrainer with LoRA (the post's rank 1, alpha 2) against `vllm_server_base_url` (the
    proxy), adapters published to `<output_dir>/.vllm_lora/`. On CPU the three patches of
    `cpu_async_grpo_patches` hold for the run; with `client_token_env` (a proxy started with
    `--client-token-env`), `trl_client_auth` does. Returns the log history and what was patched."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from colo_kit.env import has_cuda

    tok = AutoTokenizer.from_pretrained(model)
    cpu = not has_cuda()
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])
    # A progress bar, as GRPOTrainer's runs show: transformers turns it off (and prints each step's dict
    # instead) whenever its logger is quieter than WARNING, as colo_kit.quiet() sets it.
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
