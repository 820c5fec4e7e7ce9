"""Latency profiles (`<gpu>-<model>.csv`, schema in sim/latency/profile_io.py) and a generator of
synthetic ones."""
