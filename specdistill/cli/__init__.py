"""Console entry points: specdistill-train, -evaluate, -export, -regenerate, -bench (train.py, scripts/: shims)."""
