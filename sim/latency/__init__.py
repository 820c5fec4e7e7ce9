"""Latency models: how long a scheduled step takes on the simulated hardware."""
from sim.latency.base import BatchShape, LatencyModel
from sim.latency.build import LATENCY_MODELS, LatencyConfig, LatencySetup, build_latency_model
from sim.latency.operators import OperatorModel, OperatorsConfig
from sim.latency.profiled import ProfiledConfig, ProfiledModel
from sim.latency.roofline import RooflineModel
from sim.latency.shapes import Hardware, ModelShape

__all__ = ["LATENCY_MODELS", "BatchShape", "Hardware", "LatencyConfig", "LatencyModel", "LatencySetup", "ModelShape",
           "OperatorModel", "OperatorsConfig", "ProfiledConfig", "ProfiledModel", "RooflineModel",
           "build_latency_model"]
