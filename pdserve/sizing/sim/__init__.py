"""Discrete-event simulation of pdserve clusters (see cluster.py for the model and its limits)."""
