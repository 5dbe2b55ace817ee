"""Experiments and measurements, each run from a checkout as `python -m benchmarks.<name>` (peers/: against the peer
trainers, with their own dependencies). They import specdistill; nothing in specdistill imports them."""
