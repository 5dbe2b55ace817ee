"""On-policy distillation machinery (Draft-OPD, arXiv 2605.29343): rollouts on the evaluator's speculative decoder,
the drafted positions they expose, acceptance weights, and a replay buffer of rejected positions."""
from specdistill.onpolicy.replay import ReplayBuffer, ReplayItem
from specdistill.onpolicy.positions import (ACCEPTED, AFTER_REJECTION, CATEGORIES, FIRST_REJECTED, DraftedPositions,
                                           RolloutStats, TargetLogits, positions_from_rounds)
from specdistill.onpolicy.rollout import collect_rollout, prompts_from_batch
from specdistill.onpolicy.weights import decay_weights, reach_weights, tree_reach_weights

__all__ = ["ACCEPTED", "AFTER_REJECTION", "CATEGORIES", "FIRST_REJECTED", "DraftedPositions", "ReplayBuffer",
           "ReplayItem", "RolloutStats", "TargetLogits", "collect_rollout", "decay_weights",
           "positions_from_rounds", "prompts_from_batch", "reach_weights", "tree_reach_weights"]
