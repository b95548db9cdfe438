"""Server mode against colocate mode: notebook 01 (ping-pong).

- server: a `trl vllm-serve` process beside the trainers, and the weight sync over HTTP when it shares their GPU
- bench, bench_cli, bench_results: the throughput sweep, one process per configuration, and its JSON
- pingpong: the analytic model of a step in each mode, fitted to measured costs and projected to the post's
  8 GPUs
"""
