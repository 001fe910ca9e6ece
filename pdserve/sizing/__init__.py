"""Cluster sizing: `pdserve plan` (memory arithmetic), `pdserve calibrate` (a step-time profile
measured with the real engine, or a roofline profile of a GPU) and `pdserve simulate` (a
discrete-event simulation of colocated replicas or a P + D cluster driven by `pdserve bench`'s
workloads and reporting its metrics)."""
