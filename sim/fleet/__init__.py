"""The simulated fleet: replicas behind a router on one SimPy clock (fleet.py, replica.py)."""
from sim.fleet.fleet import FleetResult, FleetSimulator, ReplicaSpec
from sim.fleet.replica import ReplicaSimulator

__all__ = ["FleetResult", "FleetSimulator", "ReplicaSimulator", "ReplicaSpec"]
