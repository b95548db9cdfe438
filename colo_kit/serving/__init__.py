"""Server mode against colocate mode: notebook 01 (ping-pong). server: `trl vllm-serve` beside the trainers;
bench, bench_results: the throughput sweep and its JSON; pingpong: the analytic model of a step in each
mode, fitted to measured costs and projected to the post's 8 GPUs."""
