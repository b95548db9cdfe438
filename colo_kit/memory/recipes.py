"""Launch configs as data (notebook 04): the post's accelerate + DeepSpeed ZeRO-3 recipe for Qwen2.5-Math-72B (CPU
optimizer offload, overlap_comm, contiguous_gradients), DDP, and every node's launch line; `--write-configs` writes them.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from colo_kit.paths import REPO_ROOT

CONFIGS = REPO_ROOT / "configs"


def deepspeed_config(zero_stage: int = 3, offload_optimizer: bool = True, offload_params: bool = False) -> dict:
    """The DeepSpeed JSON; transformers' Trainer fills its "auto" values from GRPOConfig and the model."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: DeepSpeed ZeRO stages are 1, 2 or 3 (use the DDP config for 0)")
    if offload_params and zero_stage != 3:
        raise ValueError("offload_params=True needs zero_stage=3: only stage 3 partitions the weights")
    zero = {
        "stage": zero_stage,
        "offload_optimizer": {"device": "cpu" if offload_optimizer else "none", "pin_memory": True},
        "overlap_comm": True,  # one bucket's communication overlaps the next one's computation (the post's setting)
        "contiguous_gradients": True,  # one contiguous gradient buffer: no fragmentation at reduce time
        "reduce_bucket_size": "auto",
    }
    if zero_stage == 3:
        zero.update({
            "offload_param": {"device": "cpu" if offload_params else "none", "pin_memory": True},
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": True,  # a plain bf16 checkpoint, not ZeRO shards
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
        # DeepSpeed's AdamW becomes DeepSpeedCPUAdam when offloaded (DeepSpeed refuses torch's AdamW with offload)
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
        # precision, stage and offload live in the JSON only: accelerate refuses them in both places
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
    """Write `text` to `path`, or beside a different file already there as `<name>.proposed<suffix>` unless `replace`."""
    if path.exists() and path.read_text() != text and not replace:
        path = path.with_name(f"{path.stem}.proposed{path.suffix}")
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def write_configs(model: str, gpus: int, offload_optimizer: bool = True, offload_params: bool = False,
                  out: Path | None = None, gpus_per_node: int = 8, replace: bool = False) -> dict[str, Path]:
    """Write the ZeRO-3 DeepSpeed JSON, its accelerate YAML over ceil(gpus / gpus_per_node) machines and a DDP YAML."""
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
    header = (f"# Generated by colo_kit.memory.recipes.write_configs({model!r}, gpus={gpus}): {machines} machine(s) x "
              f"{min(gpus, gpus_per_node)} GPUs.\n# accelerate launch --config_file {ref(z3)} ...  (from the repo root"
              + ("; on every machine, with --machine_rank and --main_process_ip" if machines > 1 else "") + ")\n")
    z3 = _write(z3, header + yaml.safe_dump(accelerate_config(gpus, ds_ref, num_machines=machines), sort_keys=True), replace)
    ddp = _write(out / "accelerate" / f"ddp_{gpus}gpu.yaml",
                 f"# Generated by colo_kit.memory.recipes.write_configs: plain DDP on {gpus} GPU(s).\n"
                 + yaml.safe_dump(accelerate_config(gpus), sort_keys=True), replace)
    return {"deepspeed": ds_path, "accelerate_zero3": z3, "accelerate_ddp": ddp}


# Multi-node: accelerate starts one torchrun agent per machine; they meet at node 0 (rank = machine_rank * per_node + local).
SLURM_NODE_RANK = '"$SLURM_NODEID"'
SLURM_HEAD_NODE = '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'


def node_commands(model: str, gpus: int, gpus_per_node: int = 8, config_file: str | Path | None = None,
                  script: str = "train.py", script_args: list[str] | tuple[str, ...] = (),
                  main_process_ip: str = "<node 0 address>", main_process_port: int = 29500,
                  launch_args: list[str] | tuple[str, ...] = ()) -> dict:
    """The `accelerate launch` line of every node of a `gpus`-process run: {"machines", "num_processes", "per_node" (argv
    per machine), "lines", "srun"}. `launch_args` go before the script (on a CPU `--mixed_precision no`)."""
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


TRL_SERVER_FIELDS = ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_group_port")

SERVER_MODE_WHY = {
    "server_node": "`trl vllm-serve` on a node of its own, all its GPUs generating: --tensor_parallel_size splits the "
                   "model over that node's GPUs (vLLM's multiproc backend does not span machines), --host 0.0.0.0 "
                   "answers the training nodes, not only the node itself.",
    "training_nodes": "node_commands' accelerate lines for the training GPUs only (--num_machines does not count the "
                      "vLLM node); the GRPOConfig fields travel as the script's flags, as TrlParser reads them.",
    "use_vllm": "generate with vLLM, not transformers' generate.",
    "vllm_mode": "'server': ask the vLLM node over HTTP instead of building an engine in each training process.",
    "vllm_server_host": "the vLLM node's address: TRL's default 0.0.0.0 means, on a training node, that node itself, "
                        "where TRL would wait vllm_server_timeout (240 s) for a server that is not there.",
    "vllm_server_port": "the port of `trl vllm-serve --port`, open from training node 0 (whose main process alone "
                        "talks to the server) to the vLLM node.",
    "vllm_group_port": "the weight sync's NCCL rendezvous, hosted by the trainer's main process on training node 0: "
                       "free there, open from the vLLM node, and not accelerate's --main_process_port.",
    "vllm_server_base_url": "TRL 1.16 reads vllm_server_base_url first and then ignores vllm_server_host/port; this "
                            "recipe leaves it None, so TRL builds http://{vllm_server_host}:{vllm_server_port}.",
    "slurm": "one job of training nodes + 1 (the last host serves): the server step starts in the background, the "
             "script waits for its /health (a 72B load outlasts TRL's 240 s timeout), runs the training step, then "
             "ends the server step, which would otherwise hold the job until its time limit.",
}


def _shell_join(argv: list[str]) -> str:
    """shlex.join, except words that start with `"$`: shell variables a node's own shell must expand."""
    return " ".join(word if word.startswith('"$') else shlex.quote(word) for word in argv)


def server_node_commands(model: str, training_gpus: int, server_tp: int, gpus_per_node: int = 8,
                         vllm_server_host: str = "<vLLM node address>", vllm_server_port: int = 8000,
                         vllm_group_port: int = 51216, script: str = "train.py", *, server_args: list[str] | tuple[str, ...] = (),
                         health_timeout_s: int = 1800, **launch) -> dict:
    """Server mode across nodes, as TRL's 72B recipe lays it out: `training_gpus` GPUs train, one more node runs `trl
    vllm-serve` on `server_tp` GPUs. Returns each node's lines, the GRPOConfig fields, a SLURM script and "why"."""
    for name, value, least in (("training_gpus", training_gpus, 1), ("server_tp", server_tp, 1),
                               ("gpus_per_node", gpus_per_node, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r}: give a whole number of at least {least}")
    if server_tp > gpus_per_node:
        raise ValueError(f"server_tp={server_tp} is more GPUs than one node has ({gpus_per_node}): `trl vllm-serve` "
                         f"spans one node unless vLLM runs on Ray (--distributed_executor_backend ray); use "
                         f"server_tp <= {gpus_per_node}")
    main_port = int(launch.get("main_process_port", 29500))
    for name, port in (("vllm_server_port", vllm_server_port), ("vllm_group_port", vllm_group_port)):
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ValueError(f"{name}={port!r}: give a TCP port in 1..65535")
    if vllm_group_port == main_port:
        raise ValueError(f"vllm_group_port={vllm_group_port} is also accelerate's main_process_port: both listen on "
                         f"training node 0; give the weight-sync group another port (TRL's default is 51216)")
    host = str(vllm_server_host).strip()
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(f"vllm_server_host={vllm_server_host!r}: that is where a server listens, not an address to "
                         f"reach it at; on a training node it means the node itself. Give the vLLM node's address")

    grpo = {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": host, "vllm_server_port": vllm_server_port,
            "vllm_group_port": vllm_group_port}
    grpo_args = ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", host,
                 "--vllm_server_port", str(vllm_server_port), "--vllm_group_port", str(vllm_group_port)]
    serve = ["trl", "vllm-serve", "--model", str(model), "--tensor_parallel_size", str(server_tp),
             "--host", "0.0.0.0", "--port", str(vllm_server_port), *map(str, server_args)]
    user_args = [str(a) for a in launch.pop("script_args", ())]
    training = node_commands(model, training_gpus, gpus_per_node, script=script, script_args=user_args + grpo_args, **launch)
    machines = training["machines"]

    # SLURM: the same lines with the hosts as shell variables each node expands, the node rank as SLURM gives it
    slurm_launch = {**launch, "main_process_ip": '"$MAIN_NODE"'}
    slurm_grpo = grpo_args[:5] + ['"$VLLM_NODE"'] + grpo_args[6:]
    argv = node_commands(model, training_gpus, gpus_per_node, script=script, script_args=user_args + slurm_grpo,
                         **slurm_launch)["per_node"][0]
    if machines > 1:
        argv[argv.index("--machine_rank") + 1] = SLURM_NODE_RANK
    training_step = (f'srun --nodes {machines} --ntasks-per-node 1 --nodelist "$TRAIN_NODES" '
                     f"bash -c {shlex.quote(_shell_join(argv))}")
    server_step = f'srun --nodes 1 --ntasks 1 --nodelist "$VLLM_NODE" {shlex.join(serve)}'
    sbatch = "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name=grpo-{_slug(model)}-server-mode",
        f"#SBATCH --nodes={machines + 1}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        f"# Generated by colo_kit.memory.recipes.server_node_commands({str(model)!r}, training_gpus={training_gpus}, "
        f"server_tp={server_tp}): {machines} training node(s) x {min(training_gpus, gpus_per_node)} GPUs + 1 vLLM node.",
        "set -uo pipefail",
        "# The allocation's hosts in order: the first ones train, the last one serves. Node 0 of training hosts",
        "# accelerate's rendezvous (--main_process_port) and TRL's weight-sync group (vllm_group_port).",
        'NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        f'export MAIN_NODE="${{NODES[0]}}" VLLM_NODE="${{NODES[{machines}]}}"',
        f'TRAIN_NODES=$(IFS=,; echo "${{NODES[*]:0:{machines}}}")',
        "# Step 1, the vLLM node, in the background: it serves until it is ended.",
        f"{server_step} &",
        "SERVER=$!",
        f"# The trainers wait only vllm_server_timeout (240 s) for /health; a big model loads longer: wait here, "
        f"at most {health_timeout_s} s.",
        f"deadline=$((SECONDS + {health_timeout_s}))",
        f'until curl -sf "http://$VLLM_NODE:{vllm_server_port}/health" >/dev/null; do',
        '  kill -0 "$SERVER" 2>/dev/null || { echo "the vLLM server step ended before it was healthy" >&2; exit 1; }',
        f'  if (( SECONDS > deadline )); then echo "vLLM server not healthy after {health_timeout_s} s" >&2; '
        'kill "$SERVER"; exit 1; fi',
        "  sleep 10",
        "done",
        "# Step 2, the training nodes: one accelerate launcher per node, node rank from SLURM, the server's address",
        "# from $VLLM_NODE (both expanded by each node's shell).",
        training_step,
        "rc=$?",
        "# The server never exits by itself: end its step, or it holds the job until the time limit.",
        'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null',
        "exit $rc",
        "",
    ])
    return {"nodes": machines + 1, "model": str(model), "training_gpus": training_gpus, "server_tp": server_tp,
            "gpus_per_node": gpus_per_node,
            "server_node": {"argv": serve, "line": shlex.join(serve)},
            "training_nodes": training, "grpo_config": grpo, "grpo_config_args": grpo_args,
            "server_url": f"http://{host}:{vllm_server_port}",
            "slurm": {"server_step": server_step, "training_step": training_step, "sbatch": sbatch},
            "why": dict(SERVER_MODE_WHY)}
