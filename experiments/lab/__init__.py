"""Kernel and engine-step experiments: one-off measurements behind the kernels' design, run by hand on a CUDA GPU
(`python -m experiments.lab.<module>`). Not user commands; see docs/kernels.md for their findings."""
