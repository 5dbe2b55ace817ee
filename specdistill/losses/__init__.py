"""Pure per-token loss functions (divergences, acceptance, cross-entropy)."""
from specdistill.losses.divergences import (DIVERGENCES, acceptance_rate, cross_entropy, divergence, forward_kl, jsd,
                                            neg_log_acceptance, reverse_kl, total_variation)

__all__ = ["DIVERGENCES", "acceptance_rate", "cross_entropy", "divergence", "forward_kl", "jsd",
           "neg_log_acceptance", "reverse_kl", "total_variation"]
