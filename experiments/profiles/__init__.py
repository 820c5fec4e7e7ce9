"""Latency profiles (`<gpu>-<model>.csv`, schema in sim/latency/profiled.py) and a generator of
synthetic ones."""
