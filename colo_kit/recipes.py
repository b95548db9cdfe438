"""Launch configs as data: the accelerate + DeepSpeed ZeRO-3 recipe of the 72B experiment, and DDP.

The post scaled colocated GRPO to Qwen2.5-Math-72B with DeepSpeed ZeRO stage 3 (weights, gradients and
optimizer states partitioned over the GPUs), `"offload_optimizer": {"device": "cpu"}`, `"overlap_comm":
true` and `"contiguous_gradients": true`, launched with Accelerate. These functions write those files:

    configs/deepspeed/zero3_offload.json            the DeepSpeed config (values the Trainer fills are "auto")
    configs/accelerate/zero3_<model>_<N>gpu.yaml    `accelerate launch --config_file` for N processes
    configs/accelerate/ddp_<N>gpu.yaml              plain data parallelism, for models that fit without ZeRO

`colo-kit plan ... --write-configs` writes them for the planned model and GPU count.
"""

from __future__ import annotations

import json
from pathlib import Path

from colo_kit.paths import REPO_ROOT

CONFIGS = REPO_ROOT / "configs"


def deepspeed_config(zero_stage: int = 3, offload_optimizer: bool = True, offload_params: bool = False) -> dict:
    """The DeepSpeed JSON. "auto" values are filled by transformers' Trainer from GRPOConfig (batch sizes,
    gradient accumulation and clipping, bf16) and from the model (bucket sizes scale with hidden_size)."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: DeepSpeed ZeRO stages are 1, 2 or 3 (use the DDP config for 0)")
    if offload_params and zero_stage != 3:
        raise ValueError("offload_params=True needs zero_stage=3: only stage 3 partitions the weights")
    zero = {
        "stage": zero_stage,
        "offload_optimizer": {"device": "cpu" if offload_optimizer else "none", "pin_memory": True},
        # Communication of one bucket overlaps the computation of the next (the post's setting).
        "overlap_comm": True,
        # Gradients copied into one contiguous buffer as they are produced: no fragmentation at reduce time.
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    }
    if zero_stage == 3:
        zero.update({
            "offload_param": {"device": "cpu" if offload_params else "none", "pin_memory": True},
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            # Save a normal bf16 checkpoint at the end instead of ZeRO shards.
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    config = {
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:
        # DeepSpeed's own AdamW, which becomes DeepSpeedCPUAdam when offloaded (DeepSpeed refuses torch's AdamW
        # with offload). "auto" takes lr, betas, eps and weight decay from GRPOConfig. Without offload the
        # Trainer's torch AdamW is used: nothing to compile.
        config["optimizer"] = {"type": "AdamW",
                               "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    return config


def accelerate_config(num_processes: int, deepspeed_config_file: str | None = None, num_machines: int = 1) -> dict:
    """accelerate's YAML as a dict: DeepSpeed when a DeepSpeed config file is given, else multi-GPU DDP."""
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r}: use the number of GPUs (>= 1)")
    base = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": num_machines,
        "num_processes": num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if deepspeed_config_file:
        # With a DeepSpeed file, mixed precision, stage and offload live in the JSON only: accelerate refuses
        # the same settings in both places.
        base.update({"distributed_type": "DEEPSPEED",
                     "deepspeed_config": {"deepspeed_config_file": deepspeed_config_file, "zero3_init_flag": True,
                                          "deepspeed_multinode_launcher": "standard"}})
    else:
        base.update({"distributed_type": "MULTI_GPU" if num_processes > 1 else "NO", "gpu_ids": "all",
                     "mixed_precision": "bf16", "downcast_bf16": "no"})
    return base


def _slug(model: str) -> str:
    return Path(str(model)).name.lower().replace("/", "-").replace(" ", "-")


def _write(path: Path, text: str, replace: bool) -> Path:
    """Write `text` to `path`, unless a different file is already there and `replace` is False: then beside
    it, as `<name>.proposed<suffix>`, so a committed config never changes without being asked by name."""
    if path.exists() and path.read_text() != text and not replace:
        path = path.with_name(f"{path.stem}.proposed{path.suffix}")
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def write_configs(model: str, gpus: int, offload_optimizer: bool = True, offload_params: bool = False,
                  out: Path | None = None, gpus_per_node: int = 8, replace: bool = False) -> dict[str, Path]:
    """Write the ZeRO-3 DeepSpeed JSON, the matching accelerate YAML for `gpus` processes (over
    ceil(gpus / gpus_per_node) machines) and a DDP YAML. A file that exists with other contents is kept and
    the new one is written beside it (`*.proposed.*`) unless `replace`; the paths returned are those written."""
    import yaml

    out = Path(out or CONFIGS)
    (out / "deepspeed").mkdir(parents=True, exist_ok=True)
    (out / "accelerate").mkdir(parents=True, exist_ok=True)
    ds_name = "zero3" + ("_offload" if offload_optimizer else "") + ("_params" if offload_params else "") + ".json"
    ds_path = _write(out / "deepspeed" / ds_name,
                     json.dumps(deepspeed_config(3, offload_optimizer, offload_params), indent=2) + "\n", replace)
    # The YAML names the JSON relative to the repo root: run `accelerate launch` from there.
    def ref(path: Path) -> str:
        try:
            return str(path.resolve().relative_to(REPO_ROOT))
        except ValueError:
            return str(path.resolve())

    z3 = out / "accelerate" / f"zero3_{_slug(model)}_{gpus}gpu.yaml"
    ds_ref = ref(ds_path)
    machines = -(-gpus // gpus_per_node)
    header = (f"# Generated by colo_kit.recipes.write_configs({model!r}, gpus={gpus}): {machines} machine(s) x "
              f"{min(gpus, gpus_per_node)} GPUs.\n# accelerate launch --config_file {ref(z3)} ...  (from the repo root"
              + ("; on every machine, with --machine_rank and --main_process_ip" if machines > 1 else "") + ")\n")
    z3 = _write(z3, header + yaml.safe_dump(accelerate_config(gpus, ds_ref, num_machines=machines), sort_keys=True),
                replace)
    ddp = _write(out / "accelerate" / f"ddp_{gpus}gpu.yaml",
                 f"# Generated by colo_kit.recipes.write_configs: plain DDP on {gpus} GPU(s).\n"
                 + yaml.safe_dump(accelerate_config(gpus), sort_keys=True), replace)
    return {"deepspeed": ds_path, "accelerate_zero3": z3, "accelerate_ddp": ddp}



# Multi-node: the command each node runs. accelerate starts one torchrun agent per machine; the agents meet at
# node 0's address and number the processes machine by machine (global rank = machine_rank * per_node + local).

SLURM_NODE_RANK = '"$SLURM_NODEID"'
SLURM_HEAD_NODE = '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'


def node_commands(model: str, gpus: int, gpus_per_node: int = 8, config_file: str | Path | None = None,
                  script: str = "train.py", script_args: list[str] | tuple[str, ...] = (),
                  main_process_ip: str = "<node 0 address>", main_process_port: int = 29500,
                  launch_args: list[str] | tuple[str, ...] = ()) -> dict:
    """The `accelerate launch` line of every node of a `gpus`-process run over ceil(gpus / gpus_per_node) machines.

    Returns {"machines", "num_processes", "per_node": [argv of machine 0, argv of machine 1, ...], "lines": the
    same as shell lines, "srun": one SLURM line that starts them all}.

    `--num_processes` is the total over all machines (accelerate gives each machine num_processes // num_machines);
    `--machine_rank` differs per node; `--main_process_ip/--main_process_port` are node 0's. `config_file` defaults
    to the ZeRO-3 YAML `write_configs(model, gpus, gpus_per_node=...)` writes. `launch_args`: more `accelerate
    launch` flags, placed before the script (on a CPU `--mixed_precision no`: the YAML's bf16 would otherwise turn
    the Trainer's autocast on although GRPOConfig says fp32; measured in scripts/two_machines.py).

    The SLURM form runs one task per node (`srun --nodes M --ntasks-per-node 1 bash -c '...'`); each node's shell
    expands `$SLURM_NODEID` and the first host of `$SLURM_JOB_NODELIST` itself, so one line serves every node.
    """
    import shlex

    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: the total number of processes, one per GPU (>= 1)")
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r}: GPUs on each machine (>= 1)")
    machines = -(-gpus // gpus_per_node)
    if machines > 1 and gpus % gpus_per_node:
        raise ValueError(f"gpus={gpus} over machines of {gpus_per_node}: accelerate would start gpus // machines = "
                         f"{gpus // machines} processes on each of {machines} machines, not {gpus_per_node}; use a "
                         f"multiple of gpus_per_node ({machines * gpus_per_node}) or set gpus_per_node to match")
    if config_file is None:
        config_file = f"configs/accelerate/zero3_{_slug(model)}_{gpus}gpu.yaml"
    head = ["accelerate", "launch", "--config_file", str(config_file), "--num_machines", str(machines)]
    port = ["--main_process_port", str(main_process_port)]
    tail = ["--num_processes", str(gpus), *map(str, launch_args), str(script), *map(str, script_args)]
    if machines == 1:
        per_node = [head + port + tail]
        slurm = ["--machine_rank", "0"]
    else:
        per_node = [head + ["--machine_rank", str(r), "--main_process_ip", str(main_process_ip)] + port + tail
                    for r in range(machines)]
        slurm = ["--machine_rank", SLURM_NODE_RANK, "--main_process_ip", SLURM_HEAD_NODE]
    # quoted like the per-node lines, except SLURM's variables, which each node's shell must expand
    inner = " ".join([shlex.join(head), *(part if part.startswith('"$') else shlex.quote(part) for part in slurm),
                      shlex.join(port + tail)])
    return {"machines": machines, "num_processes": gpus, "per_node": per_node,
            "lines": [shlex.join(argv) for argv in per_node],
            "srun": f"srun --nodes {machines} --ntasks-per-node 1 bash -c {shlex.quote(inner)}"}
