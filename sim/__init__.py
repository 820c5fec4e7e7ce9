"""The discrete-event simulator backend (SimPy) and its latency models."""
from sim.latency import Hardware, LatencyModel, ModelShape, ProfiledModel, RooflineModel
from sim.simulator import SIM_TOKEN, SimResult, Simulator

__all__ = [
           "SIM_TOKEN",
           "Hardware",
           "LatencyModel",
           "ModelShape",
           "ProfiledModel",
           "RooflineModel",
           "SimResult",
           "Simulator",
]
