"""Benchmarks. Each fixes its seeds, warms up, states hardware/model/workload, and prints one
table whose timings are ratios against a baseline measured in the same run."""
