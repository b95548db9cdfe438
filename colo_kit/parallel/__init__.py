"""Tensor parallelism (tp) and multi-process cells launched from a notebook (launch): notebook 03."""
