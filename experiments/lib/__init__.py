"""Library code of the experiment commands: config -> objects (factory), workloads, backends,
traces, metrics, plots, bootstrap statistics, the fidelity and profiling helpers."""
