"""Speculative decoding shared by evaluation and on-policy training: propose (drafters), verify, generate -> Rollout."""

from .compiled import BATCH_BUCKETS, CompileStats, RecompileError, batch_bucket, compile_stats
from .drafters import Drafter, LMDrafter, NGramDrafter
from .generate import (DynamicGamma, FixedGamma, GammaPolicy, RoundRecord, Rollout, Strategy, speculative_generate,
                       target_generate)
from .kv import CacheMode
from .sampling import (DEFAULT_DRAFT_POLICY, DRAFT_POLICIES, Sampler, check_draft_policy, draft_temperature,
                       probs_from_logits, sample)
from .tree import Proposal, TreeShape
from .verify import Verdict, verify

__all__ = [
    "CacheMode", "BATCH_BUCKETS", "CompileStats", "RecompileError", "batch_bucket", "compile_stats",
    "Drafter", "LMDrafter", "NGramDrafter", "Proposal",
    "DynamicGamma", "FixedGamma", "GammaPolicy", "RoundRecord", "Rollout", "Strategy", "speculative_generate",
    "target_generate",
    "DEFAULT_DRAFT_POLICY", "DRAFT_POLICIES", "Sampler", "check_draft_policy", "draft_temperature",
    "probs_from_logits", "sample",
    "Verdict", "verify", "TreeShape",
]
