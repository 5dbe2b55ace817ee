"""Console entry points: specdistill-train, -evaluate, -export, -regenerate, -bench (train.py and scripts/ are shims)."""
