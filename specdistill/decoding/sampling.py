"""Token sampling shared by target and draft: temperature, nucleus (top-p), temperature 0 as greedy, and the drafting
policy (whether a draft samples its proposals from q or proposes q's argmax)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


# How a draft proposes at temperature > 0 (at temperature 0 both are greedy verification):
#   sample  d ~ q, verified by exact rejection sampling with q (accept with min(1, p(d)/q(d)), resample norm(p - q)+)
#   greedy  d = argmax q, verified as a one-hot proposal: accept with p(d), else resample from p without d,
#           renormalised. Still lossless, and what the serving engines do (vLLM's EAGLE proposer drafts the argmax).
DRAFT_POLICIES = ("greedy", "sample")
DEFAULT_DRAFT_POLICY = "greedy"  # the engines' choice, so that T > 0 acceptance here is what a deployment sees


def check_draft_policy(policy: str, where: str = "draft_policy") -> None:
    if policy not in DRAFT_POLICIES:
        raise ValueError(f"{where}={policy!r}: choose one of {DRAFT_POLICIES} (greedy = argmax drafts as vLLM / SGLang "
                         "serve EAGLE; sample = drafts sampled from q)")


def draft_temperature(policy: str, temperature: float) -> float:
    """The temperature the draft's q is processed at under `policy`: 0 (one-hot argmax) for greedy drafts."""
    check_draft_policy(policy)
    return 0.0 if policy == "greedy" else temperature


def check_sampling(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p}")


def probs_from_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probs. Temperature 0 is greedy: one-hot at the argmax."""
    check_sampling(temperature, top_p)
    logits = logits.float()
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits if temperature == 1 else logits / temperature, dim=-1)  # x / 1.0 is x
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)          # (..., V)
        # Drop a token once the tokens ranked above it already cover top_p (the top token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)                 # back to vocab order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U[0, 1) of `shape` on `device`, drawn from `generator` (on whatever device the generator lives)."""
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of (..., V) probs (need not be normalized), by inverse CDF: one uniform per row."""
    cdf = probs.float().cumsum(-1)                                         # (..., V)
    u = uniform(tuple(probs.shape[:-1]), generator, probs.device) * cdf[..., -1]
    # right=True picks the first index with cdf > u: a zero-probability token is never chosen.
    token = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    return token.clamp_(max=probs.shape[-1] - 1)


@dataclass
class Sampler:
    """How tokens are drawn, for the target and the draft alike (speculative sampling needs both to match)."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_p)

    def for_drafts(self, policy: str) -> "Sampler":
        """The sampler a drafter proposes with under the drafting policy: this one (sample), or greedy (argmax, q
        one-hot: Proposal.probs None, which verify() treats as a one-hot proposal)."""
        check_draft_policy(policy)
        return self if policy == "sample" or self.greedy else Sampler(0.0)

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(..., V) logits -> tokens (...), probs (..., V); greedy returns probs None (one-hot by convention)."""
        if self.greedy:
            return logits.argmax(-1), None
        probs = self.probs(logits)
        return sample(probs, self.generator), probs
