"""Building blocks of `python -m experiments.profile`: synthetic steps, host-overhead measurement,
the profile grid and the profile CSV writer."""
