"""Capacity search (`python -m experiments.search`, docs/search.md): the deployments of one model
over a GPU catalogue, each one's highest request rate within the SLOs, its cost, the Pareto front
and the cheapest deployment for a target rate."""
