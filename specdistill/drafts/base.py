"""The draft adapter interface: everything training, decoding, evaluation and export need from one kind of draft.

One subclass per kind (drafts/lm.py: standalone causal LMs; drafts/eagle3/: EAGLE-3 heads; drafts/dflash/: DFlash
block drafters), each registered with its spec by drafts/registry.py's register_kind. Callers ask
`draft_adapter(model)` (a built draft) or `kind_for_init(init)` (a config) and never test a draft's type themselves,
so a new kind (MTP heads) is one new folder (model.py, drafter.py, adapter.py, export.py). This package knows nothing
of objectives, rollouts or the evaluator: they sit above it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

from specdistill.decoding import Drafter, probs_from_logits
from specdistill.tensors import unwrap

if TYPE_CHECKING:
    from specdistill.drafts.registry import DraftKind


class _FromSpec:
    """An adapter attribute that is a field of its kind's spec (adapter.kind is adapter.spec.name), on the class and
    on an instance."""

    def __init__(self, field: str):
        self.field = field

    def __get__(self, adapter, cls):
        return getattr(cls.spec, self.field)


class DraftAdapter:
    """Wraps one draft model (possibly inside a DDP / accelerate wrapper: forwards with grad go through the wrapper).

    Shapes: P drafted positions, R context rows, V the target's vocabulary, Vd the draft's output vocabulary
    (V for an LM draft, the head's reduced vocabulary for EAGLE-3).
    """

    spec: ClassVar[DraftKind]  # what the kind is (drafts/registry.py), set by register_kind
    # read from the spec on the class and on an adapter alike
    kind = _FromSpec("name")
    decodes_alone = _FromSpec("decodes_alone")
    trains_on_trees = _FromSpec("trains_trees")
    serves_trees = _FromSpec("serves_trees")

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def module(self) -> torch.nn.Module:
        return unwrap(self.model)

    # ------------------------------------------------------------------------------------------- building
    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        """Whether an (unwrapped) model is a draft of this kind."""
        raise NotImplementedError

    @classmethod
    def build(cls, draft_cfg, target, data) -> torch.nn.Module:
        """A trainable draft from the `draft` config group for `target` (models.target.Target); `data`
        (data.dataset.TokenizedData, may be None) for drafts that learn their vocabulary or calibrate on it."""
        raise NotImplementedError

    @classmethod
    def saved_in(cls, path) -> bool:
        """Whether a draft folder written by training (checkpoint/draft) holds this kind."""
        raise NotImplementedError

    @classmethod
    def load(cls, path) -> torch.nn.Module:
        """The draft saved in `path` (a folder for which saved_in is true)."""
        raise NotImplementedError

    @classmethod
    def unreadable(cls, path) -> Optional[str]:
        """Why a folder that looks like this kind's cannot be read back (an export in a format specdistill does not
        load), or None. Default: None."""
        return None

    @classmethod
    def warm_start_overrides(cls, path) -> list[str]:
        """Config overrides that build this kind from the draft saved in `path` (a warm start, a re-evaluation)."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, draft_cfg, target_config) -> None:
        """Before any weights load: raise, naming the draft.* key, when the `draft` config (config.DraftConfig) cannot
        work with this target (its HF config). Default: nothing to check."""

    @classmethod
    def target_layers(cls, draft_cfg, target_config) -> Optional[list[int]]:
        """The target's hidden_states ids this kind reads, as the `draft` config sets them (regeneration captures
        them); None: the kind sets the target up itself (prepare_target)."""
        return None

    @classmethod
    def prepare_target(cls, target) -> None:
        """Set up the target (models.target.Target) before it decodes for data regeneration (default: nothing)."""

    # ------------------------------------------------------------------------------------------- decoding
    def drafter(self, confidence: float = 0.0) -> Drafter:
        """The decoding engine's proposer for this draft (decoding/)."""
        raise NotImplementedError

    def at_block_size(self, block_size: int) -> torch.nn.Module:
        """The draft proposing block_size - 1 tokens per forward (block drafters; the block size sweep of
        eval.block_sizes). Default: refused, this kind drafts token by token."""
        raise ValueError(f"eval.block_sizes: a {self.kind} draft has no block size (it drafts token by token); the "
                         "sweep applies to block drafters (draft=dflash)")

    def check_target(self, target_model: torch.nn.Module, why: str) -> None:
        """Raise a ValueError saying `why` unless the draft scores the target's token ids."""
        raise NotImplementedError

    def max_positions(self) -> Optional[int]:
        raise NotImplementedError

    def check_prompts(self, prompt_mask: torch.Tensor) -> None:  # (B, T) left-padded
        """Raise if the draft cannot draft after these prompts (default: any non-empty prompt will do)."""

    def row_feature_layers(self) -> Optional[list[int]]:
        """The target's hidden_states ids logits_at reads per rollout row, captured by the
        rollout's own verify forwards (decoding.speculative_generate(capture_layers=...)); None: tokens only."""
        return None

    # ------------------------------------------------------------------------------------------- training
    def logits_at(self, rows: list[torch.Tensor], row: torch.Tensor, context_len: torch.Tensor, index: torch.Tensor,
                  features: Optional[torch.Tensor], pad_id: int, shares: Optional[list[int]] = None,
                  feature_row: Optional[list[int]] = None) -> torch.Tensor:
        """(P, Vd) the draft's next-token logits after rows[row[p]][:context_len[p]] WITH grad, one forward.
        rows: R x (L_r,) long; row, context_len, index (0-based draft position in its round): (P,) long;
        features: (S, L, D) target features (row_feature_layers) or None; row r reads features[feature_row[r]]
        (feature_row None: S = R, row r reads its own; a rollout's branch rows read their trajectory's,
        DraftedPositions.source, so S is the number of trajectories, not of rows);
        shares: None, or (R,) row r agrees with row shares[r] (tokens and features) up to where its positions' round
        began (a branch row and its trajectory, DraftedPositions.source): a draft may reuse that row's work."""
        raise NotImplementedError

    def restrict(self, p_logits: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Target logits (P, V) -> (logits over the draft vocabulary (P, Vd), (P,) bool whether the target's argmax
        lies in it, or None when the draft vocabulary is the target's)."""
        return p_logits, None

    def alpha(self, p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float,
              q_temperature: Optional[float] = None) -> torch.Tensor:
        """(P,) sum_x min(p, q) as verification sees it: p (P, V) full, q (P, Vd), after the decoder's processing
        at `temperature` (one-hot argmax match at 0). q_temperature: q's own (None = temperature; 0 = argmax drafts,
        the greedy drafting policy, for which this is p(argmax q))."""
        raise NotImplementedError

    def soft_alpha(self, p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(P,) sum_x min(p, q) at a loss temperature (> 0): the replay priority is 1 - this."""
        return self.alpha(p_logits, q_logits, temperature)

    def chain_counts(self, target_out: Any, batch: dict, gamma: int) -> torch.Tensor:
        """(gamma + 1,) teacher-forced chain counts on a collated batch (eval/simulated.py): reached[k] = chains
        whose first k drafts all match the target's argmax. target_out: models.target.TargetOutput."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- export
    @classmethod
    def card_section(cls, repo_id: str, target: str, exports: list[str], gamma: int) -> str:
        """The model card's "how to serve it" section (markdown), for vLLM and SGLang."""
        raise NotImplementedError


def group_size(counts: list[int], keys: int, unit_slots: int = 1) -> int:
    """How many of a row's units (an EAGLE-3 head's chains, a DFlash drafter's blocks of `unit_slots` query slots) one
    group of a training forward holds, given each row's unit count and the context keys a group copies from its row:
    the power of two (up to the busiest row's count) with the least work, counted in query slots run (padding
    included) plus KEY_COST_RATIO key columns per slot's worth for each group's copy of the context. A row with many
    units spans several groups, one with few fills one, instead of every row padded to the busiest."""
    most = max(counts)
    sizes = sorted({most} | {1 << i for i in range(most.bit_length()) if 1 << i < most})

    def cost(c: int) -> float:
        groups = sum(-(-n // c) for n in counts)
        return groups * c * unit_slots + groups * keys / KEY_COST_RATIO

    return min(sizes, key=cost)


# Context key columns per query slot of equal cost in group_size: a slot runs the whole layer (projections and MLP), a
# key column is copied once per group and read by the group's queries. Set on CPU, where it gave an EAGLE-3 head's
# groups of 32 chains for rollout rows of ~110 chains beside replayed contexts of 1-30 (docs/results.md).
KEY_COST_RATIO = 16


def feature_rows(bases: list[int], feature_row: Optional[list[int]], device) -> torch.Tensor:
    """(Rb,) long: the rows of a logits_at features tensor that base rows `bases` read (feature_row None: their own)."""
    return torch.tensor(bases if feature_row is None else [feature_row[b] for b in bases], dtype=torch.long,
                        device=device)


def decoding_precision(target_model: torch.nn.Module):
    """The context a draft decodes in beside `target_model` (evaluation, rollouts): autocast to the target's dtype
    when that is bf16 / fp16, so the draft's matmuls run at the target's precision and speed while a training draft
    keeps its fp32 weights; nothing for an fp32 target. Verification stays fp32 whatever this is (decoding/ casts the
    probabilities it compares)."""
    p = next(target_model.parameters())
    return torch.autocast(p.device.type, dtype=p.dtype, enabled=p.dtype in (torch.bfloat16, torch.float16))


def cast_for_decoding(draft: torch.nn.Module, target_model: torch.nn.Module) -> torch.nn.Module:
    """A draft loaded only to decode (evaluation) in its target's floating dtype: beside a bf16 target, a bf16 draft
    (half the memory, the target's matmul speed). Verification stays fp32 (decoding/ casts the probabilities)."""
    dtype = next(target_model.parameters()).dtype
    return draft.to(dtype) if dtype.is_floating_point else draft


def chain_counts(match: torch.Tensor, valid: torch.Tensor, gamma: int) -> torch.Tensor:
    """match, valid: (B, T) bool. Returns reached (gamma+1,): reached[k] = #starts whose next k positions all
    agree (reached[0] = #valid starts). Summed counts, so ratios can be taken after reducing over batches/ranks."""
    ok = valid.clone()  # (B, T) chains alive at depth 0
    reached = [ok.sum()]
    good = match & valid
    T = match.shape[1]
    for k in range(gamma):
        shifted = torch.zeros_like(good)
        shifted[:, : T - k] = good[:, k:]  # position t+k agrees
        ok = ok & shifted
        reached.append(ok.sum())
    return torch.stack(reached)


def min_sum(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float,
            q_temperature: Optional[float] = None) -> torch.Tensor:
    """sum_x min(p, q) after the decoder's own processing at `temperature` (one-hot argmax match at 0); q at
    q_temperature when given (0: argmax drafts). (N,)"""
    q = probs_from_logits(q_logits, temperature if q_temperature is None else q_temperature)
    return torch.minimum(probs_from_logits(p_logits, temperature), q).sum(-1)


def min_sum_on_draft_vocab(p_logits: torch.Tensor, q_logits: torch.Tensor, t2d: torch.Tensor, temperature: float,
                           q_temperature: Optional[float] = None) -> torch.Tensor:
    """sum_x min(p, q) as verification sees it for a draft with a reduced vocabulary: full p (P, V) against q (P, Vd)
    placed on its target ids t2d (V,) bool (zero elsewhere), both after the decoder's processing at `temperature`
    (q at q_temperature when given: 0 = argmax drafts). (P,)"""
    p = probs_from_logits(p_logits, temperature)[:, t2d]                     # (P, Vd): p on the draft's ids
    q = probs_from_logits(q_logits, temperature if q_temperature is None else q_temperature)  # (P, Vd)
    return torch.minimum(p, q).sum(-1)
