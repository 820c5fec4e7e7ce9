"""Latency models: how long a scheduled step takes on the simulated hardware."""
from sim.latency.base import BatchShape, LatencyModel
from sim.latency.profiled import ProfiledModel
from sim.latency.roofline import RooflineModel
from sim.latency.shapes import Hardware, ModelShape

__all__ = ["BatchShape", "Hardware", "LatencyModel", "ModelShape", "ProfiledModel", "RooflineModel"]
