"""The smallest changes each peer trainer needs to train on a CPU, one file per peer, each saying what and why."""
