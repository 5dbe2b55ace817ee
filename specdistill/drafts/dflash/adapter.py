"""Draft adapter for DFlash block drafters (model.py): drafting through DFlashDrafter, and, for Draft-OPD, the
with-grad loss forward as one block per (row, round).

A drafted position p of a rollout is block position index[p] + 1 of the round whose anchor (pending token) sits at
a = context_len[p] - index[p] - 1: its logits depend on the row's target features before a and on the token at a
only, never on the drafts before it. So a branch row (a rejected draft in place, DraftedPositions) gives the same
logits as its trajectory at the same anchor, and every (trajectory, anchor) runs one block, whatever row asked.
The target features of the rows are those the rollout's verify forwards computed anyway
(decoding.speculative_generate(capture_layers=...)): no second target pass. q is over the draft vocabulary (the
target's unless draft.draft_vocab_size reduces it: then the loss compares q with p restricted to it, as the dflash
objective does, and acceptance uses the full p against q placed on its target ids, as verification).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from specdistill.decoding import Drafter
from specdistill.decoding.kv import logits_dim
from specdistill.drafts.base import DraftAdapter, feature_rows, group_size, min_sum, min_sum_on_draft_vocab
from specdistill.drafts.readback import unfit
from specdistill.drafts.registry import Card, DraftLength, register_kind
from specdistill.models.vocab import frequent_token_vocab, restrict_to_draft_vocab
from specdistill.tensors import unwrap
from specdistill.tokens import check_vocab_compatible

from .drafter import DFlashDrafter
from .export import check_target, export_dflash, validate_export
from .model import ARCHITECTURE, DFlashDraft, build_dflash, check_settings, with_block_size


def fits_target(draft, path, target_model, target_name: str, log) -> None:
    """A DFlash draft read back beside its target: the layers, width and vocabulary it reads must be the target's."""
    problems = check_target(draft.config, target_model.config.get_text_config().to_dict())
    if problems:
        raise unfit(path, target_name, "; ".join(problems))


def block_length(draft_cfg, saved: Optional[Path]) -> Optional[DraftLength]:
    """A block drafter proposes at most block_size - 1 tokens a round: the block size of the drafter saved at
    eval.draft_path (its config.json) when given, else draft.dflash.block_size."""
    if saved is not None:
        try:
            block = json.loads((Path(saved) / "config.json").read_text()).get("block_size")
        except (OSError, ValueError, AttributeError):
            return None  # the draft loader names a missing or unreadable folder
        source = f"the drafter at eval.draft_path has block_size={block}"
    else:
        block = draft_cfg.dflash.block_size
        source = f"draft.dflash.block_size={block}"
    if not isinstance(block, int):
        return None
    return DraftLength(block - 1, f"what a DFlash block drafts ({source}: one forward proposes block_size - 1 = "
                                  f"{block - 1} tokens)",
                       lambda asked: f"draft.dflash.block_size={asked + 1} (and train at it)")


def describe_folder(config: dict) -> Optional[str]:
    """A DFlash drafter's folder (ours, or vLLM's layout by another tool), from its config.json."""
    archs = [str(a) for a in config.get("architectures") or []]
    if any("dflash" in a.lower() for a in archs) or "dflash_config" in config:
        return f"a DFlash block drafter (architectures {archs})"
    return None


@register_kind(name="dflash", inits={"dflash": ("intermediate_size",)},  # any layer count, the target's width
               path_inits=("dflash",),     # draft.path: a warm start
               decodes_alone=False,        # every block reads the target's hidden states
               trains_trees=False,         # its block positions see the anchor only, not the tree node they extend
               serves_trees=False,         # vLLM's dflash method drafts chains; its trees are specdistill's decoding
               data_objective="dflash",    # its data loss is the block loss (objectives/dflash.py)
               warmup_objective={"name": "dflash"},  # Draft-OPD warms it up as recipe dflash_serve trains it
               card=Card("A DFlash block drafter", library="specdistill", tags=("dflash",)),
               exporters={"vllm": export_dflash}, validator=validate_export, export_architectures=(ARCHITECTURE,),
               fits=fits_target, max_draft_length=block_length, describe_folder=describe_folder)
class DFlashDraftKind(DraftAdapter):
    """A DFlashDraft on the target's multi-layer hidden states: q over the target's vocabulary."""

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        return isinstance(model, DFlashDraft)

    @classmethod
    def check_config(cls, draft_cfg, target_config) -> None:
        """Before any weights load: the block size, the target layer ids and the mask token against the target's
        config (its layer count and vocabulary)."""
        d = draft_cfg.dflash
        check_settings(d.block_size, d.target_layer_ids, d.mask_token_id, target_config.num_hidden_layers,
                       target_config.vocab_size, d.sliding_window)

    @classmethod
    def build(cls, draft_cfg, target, data) -> torch.nn.Module:
        d = draft_cfg.dflash
        if draft_cfg.path:
            model = DFlashDraft.from_pretrained(draft_cfg.path)
            check_vocab_compatible(model.config.vocab_size, logits_dim(target.model), "warm-start only from a DFlash "
                                   "draft trained for this target", what=f"DFlash draft at {draft_cfg.path}")
            if model.config.block_size != d.block_size:
                raise ValueError(f"draft.dflash.block_size={d.block_size} but the draft at {draft_cfg.path} was "
                                 f"trained with {model.config.block_size}: a warm start keeps its block size; set "
                                 f"draft.dflash.block_size={model.config.block_size}")
        else:
            model = build_dflash(target.model, draft_cfg.num_layers, d.block_size, d.target_layer_ids, d.mask_token_id,
                                 draft_cfg.intermediate_size, d.sliding_window, draft_vocab(draft_cfg, target, data))
        target.set_aux_layer_ids(model.config.aux_layer_ids)
        return model.train()

    @classmethod
    def saved_in(cls, path) -> bool:
        cfg_file = Path(path) / "config.json"
        return cfg_file.exists() and ARCHITECTURE in json.loads(cfg_file.read_text()).get("architectures", [])

    @classmethod
    def load(cls, path) -> torch.nn.Module:
        return DFlashDraft.from_pretrained(path)

    @classmethod
    def warm_start_overrides(cls, path) -> list[str]:
        block = json.loads((Path(path) / "config.json").read_text())["block_size"]
        return ["draft=dflash", f"draft.path={path}", f"draft.dflash.block_size={block}"]

    @classmethod
    def target_layers(cls, draft_cfg, target_config) -> Optional[list[int]]:
        """hidden_states ids l + 1 of the draft's target layers (draft.dflash.target_layer_ids or the defaults)."""
        from .model import default_target_layer_ids

        ids = draft_cfg.dflash.target_layer_ids
        if ids is None:
            ids = default_target_layer_ids(target_config.num_hidden_layers, draft_cfg.num_layers)
        return [l + 1 for l in ids]

    # ------------------------------------------------------------------------------------------- decoding
    def drafter(self, confidence: float = 0.0) -> Drafter:
        return DFlashDrafter(self.module, confidence=confidence)

    def at_block_size(self, block_size: int) -> torch.nn.Module:
        return with_block_size(self.module, block_size)

    def check_target(self, target_model, why: str) -> None:
        c = self.module.config
        check_vocab_compatible(c.vocab_size, logits_dim(target_model), why, what="DFlash draft")
        t = target_model.config.get_text_config()
        if t.num_hidden_layers != c.num_target_layers or t.hidden_size != c.target_hidden_size:
            raise ValueError(f"the DFlash draft reads layers {c.target_layer_ids} of a {c.num_target_layers}-layer "
                             f"target of width {c.target_hidden_size}; this target has {t.num_hidden_layers} layers "
                             f"of width {t.hidden_size}: use the target it was trained for")

    def max_positions(self) -> Optional[int]:
        return self.module.config.max_position_embeddings

    def row_feature_layers(self) -> Optional[list[int]]:
        return list(self.module.config.aux_layer_ids)

    # ------------------------------------------------------------------------------------------- training
    def logits_at(self, rows, row, context_len, index, features, pad_id: int, shares=None,
                  feature_row=None) -> torch.Tensor:
        return dflash_logits_at(self.model, rows, features, row, context_len, index, shares, feature_row)

    def restrict(self, p_logits: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        t2d = self.module.t2d
        return (p_logits, None) if bool(t2d.all()) else restrict_to_draft_vocab(p_logits, t2d)

    def alpha(self, p_logits, q_logits, temperature: float, q_temperature=None) -> torch.Tensor:
        t2d = self.module.t2d
        if bool(t2d.all()):
            return min_sum(p_logits, q_logits, temperature, q_temperature)
        return min_sum_on_draft_vocab(p_logits, q_logits, t2d, temperature, q_temperature)

    def chain_counts(self, target_out, batch: dict, gamma: int) -> torch.Tensor:
        return dflash_chain_counts(self.model, target_out, batch, gamma)

    # ------------------------------------------------------------------------------------------- export
    @classmethod
    def card_section(cls, repo_id: str, target: str, exports: list[str], gamma: int) -> str:
        v = "serving/vllm" if "vllm" in exports else "<export with scripts/export.py --format vllm>"
        return f"""This is a DFlash block drafter: one forward proposes a block of `block_size - 1` tokens from the
target's hidden states. The repository root holds specdistill's own format (with frozen copies of the target's
embedding and LM head); vLLM reads the export in `{v}`, which shares the target's. Serve it with
`num_speculative_tokens` = block_size - 1 (its config.json's `block_size`):

```bash
huggingface-cli download {repo_id} --local-dir draft
vllm serve {target} --speculative-config \\
    '{{"method": "dflash", "model": "draft/{v}", "num_speculative_tokens": <block_size - 1>}}'
```
"""


def draft_vocab(draft_cfg, target, data) -> Optional[torch.Tensor]:
    """The target ids a reduced draft vocabulary keeps (draft.draft_vocab_size below the target's vocabulary): the
    training data's most frequent answer tokens, ascending; None for the whole vocabulary."""
    V, Vd = logits_dim(target.model), draft_cfg.draft_vocab_size
    if Vd is None or Vd >= V:
        return None
    if data is None:
        raise ValueError(f"draft.draft_vocab_size={Vd} keeps the training data's most frequent tokens, and there is no "
                         "training data here: set draft.draft_vocab_size=null (the whole vocabulary) or load a trained "
                         "draft (eval.draft_path)")
    return frequent_token_vocab(data.train, V, Vd)


def dflash_logits_at(model, rows: list[torch.Tensor], features: torch.Tensor, row: torch.Tensor,
                     context_len: torch.Tensor, index: torch.Tensor,
                     shares: Optional[list[int]] = None,
                     feature_row: Optional[list[int]] = None) -> torch.Tensor:
    """(P, Vd) the draft's logits at each drafted position, WITH grad: block position index[p] + 1 of the block
    anchored at context_len - index - 1 of its row (module docstring). One block per (base row, anchor), where the
    base row is shares[row] (a branch row's trajectory, whose tokens agree up to the anchor: checked). feature_row (R,):
    the row of features that row r reads (None: its own)."""
    device = features.device
    inner = unwrap(model)
    anchor = context_len - index - 1                                           # (P,)
    base = row if shares is None else torch.as_tensor(shares, dtype=torch.long, device=row.device)[row]
    block_of: dict[tuple[int, int], int] = {}
    per_base: dict[int, list[int]] = {}
    for r, b, a in zip(row.tolist(), base.tolist(), anchor.tolist()):
        if r != b and not torch.equal(rows[r][: a + 1], rows[b][: a + 1]):
            raise ValueError(f"dflash_logits_at: shares[{r}] = {b}, but the rows' tokens differ before {a + 1}")
        if (b, a) not in block_of:
            per_base.setdefault(b, []).append(a)
            block_of[(b, a)] = len(block_of)
    bases = sorted(per_base)
    L = max(max(per_base[b]) for b in bases)                                   # context slots any block reads
    # groups of at most n blocks, each over one base row's context: a rollout trajectory's many blocks span several
    # groups, a replayed context's few fill one, instead of every row padded to the busiest row's count
    n = group_size([len(per_base[b]) for b in bases], L, unit_slots=inner.block_size)
    groups = [(i, per_base[b][k: k + n]) for i, b in enumerate(bases) for k in range(0, len(per_base[b]), n)]
    anchors = torch.zeros(len(groups), n, dtype=torch.long, device=device)
    anchor_pos = torch.zeros_like(anchors)
    where: dict[int, tuple[int, int]] = {}
    for gi, (i, anchored) in enumerate(groups):
        b = bases[i]
        for j, a in enumerate(anchored):
            anchors[gi, j], anchor_pos[gi, j] = rows[b][a], a
            where[block_of[(b, a)]] = (gi, j)
    feats = features[feature_rows(bases, feature_row, device), :L]             # (Rb, L, D)
    if feats.shape[1] < L:
        feats = torch.cat([feats, feats.new_zeros(len(bases), L - feats.shape[1], feats.shape[2])], dim=1)
    lengths = torch.tensor([len(rows[b]) for b in bases], device=device)
    valid = torch.arange(L, device=device)[None] < lengths[:, None]           # (Rb, L)
    group_row = None if len(groups) == len(bases) else torch.tensor([i for i, _ in groups], device=device)
    hidden = model(feats, valid, anchors, anchor_pos, group_row)               # (G, n, B, H)
    at = torch.tensor([where[block_of[(b, a)]] for b, a in zip(base.tolist(), anchor.tolist())],
                      dtype=torch.long, device=device)                         # (P, 2)
    return inner.logits(hidden[at[:, 0], at[:, 1], index + 1])                 # (P, Vd)


def chain_anchors(loss_mask: torch.Tensor, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Evenly spaced anchors for teacher-forced evaluation: positions a >= 1 with loss_mask[a] (block position 1 is a
    loss token), at most per_row per row. loss_mask (B, T) bool -> anchors (B, n) long, valid (B, n) bool."""
    B, T = loss_mask.shape
    ok = loss_mask.clone()
    ok[:, 0] = False
    counts = ok.sum(1)                                                         # (B,)
    n = max(1, min(per_row, int(counts.max())))
    pick = (torch.arange(n, device=loss_mask.device)[None] * counts[:, None]) // n  # (B, n) ranks chosen
    anchors = torch.zeros(B, n, dtype=torch.long, device=loss_mask.device)
    for b in range(B):
        cand = ok[b].nonzero().squeeze(-1)
        if len(cand):
            anchors[b] = cand[pick[b].clamp(max=len(cand) - 1)]
    valid = torch.arange(n, device=loss_mask.device)[None] < counts[:, None]
    return anchors, valid


@torch.no_grad()
def dflash_chain_counts(model, target_out, batch: dict, gamma: int, per_row: int = 16) -> torch.Tensor:
    """(K+1,) teacher-forced chain counts (eval/simulated.py) over up to per_row evenly spaced anchors per row: a
    chain from anchor a reaches k if block positions 1..k all propose the target's argmax for tokens a+1 .. a+k (loss
    positions all). K = min(gamma, block size - 1): a block drafts no further, so the counts stop there and the
    report's gamma is the one that ran."""
    inner = unwrap(model)
    lm = batch["loss_mask"].bool()                                             # (B, T)
    ids = batch["input_ids"]
    anchors, valid = chain_anchors(lm, per_row)                                # (B, n)
    hidden = model(target_out.aux_hidden, batch["attention_mask"].bool(), ids.gather(1, anchors), anchors)
    K = min(gamma, inner.block_size - 1)
    draft_argmax = inner.draft_to_target(inner.logits(hidden[:, :, 1: 1 + K]).argmax(-1))  # (B, n, K) target ids
    T = ids.shape[1]
    at = (anchors[..., None] + torch.arange(K, device=ids.device)).clamp(max=T - 1)  # (B, n, K) target positions
    target_argmax = target_out.logits.argmax(-1)                               # (B, T)
    hit = (draft_argmax == target_argmax.gather(1, at.flatten(1)).view_as(at)) & lm.gather(1, at.flatten(1)).view_as(at)
    hit &= (anchors[..., None] + torch.arange(K, device=ids.device)) < T
    ok = valid.clone()
    reached = [ok.sum()]
    for k in range(K):
        ok = ok & hit[..., k]
        reached.append(ok.sum())
    return torch.stack(reached)
