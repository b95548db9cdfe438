"""Tensor parallelism and multi-GPU cells: notebook 03 (TP tuning).

- tp: TP groups for colocated engines, the sweep over TP sizes
- launch: multi-process cells launched from a notebook (torch's elastic_launch), results returned per rank
"""
