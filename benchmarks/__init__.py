"""Benchmarks that sit outside the package: scripts with their own dependencies (the peer trainers)."""
