"""Draft adapter for EAGLE-3 heads (arXiv 2503.01840): drafting through Eagle3Drafter, and, for Draft-OPD
(arXiv 2605.29343), the with-grad loss forward as the head's training-time-test unroll on its own features.

Bookkeeping (model.py, drafter.py): with context x_0 .. x_{N-1} (x_{N-1} pending), the head
drafts d_1 from slot N-2 (target feature g_{N-2} with token x_{N-1}), and draft step i stays on slot N-2, feeds d_i
with the head's own previous output, RoPE position N-2+i. The TTT unroll `head(aux, ids, mask, steps)` computes
exactly this at every slot t and step j (slot t, step j reads token t+1+j): drafted position i of a round whose
context has N tokens is step i at slot N-2 of a row whose tokens N .. N+i-1 are d_1 .. d_i. On-trajectory positions
read the final trajectory; positions after a rejection read their round's branch row (the rejected draft in place),
whose slots <= N-2 carry the trajectory's target features (only those are read: step-0 attention is causal, later
steps only see their own slot).

The target's aux hidden states for the rows are those the rollout's verify forwards computed anyway (captured by
decoding.speculative_generate(capture_layers=aux_layer_ids)): no second target pass. The loss compares q over the
draft vocabulary with the target's distribution restricted to it (renormalised), masking positions whose target
argmax lies outside it, as the eagle3 objective does; acceptance (weights, priorities) uses the full p against q
scattered to target ids, as verification.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from specdistill.decoding import Drafter
from specdistill.decoding.kv import logits_dim
from specdistill.drafts.base import DraftAdapter, feature_rows, group_size, min_sum_on_draft_vocab
from specdistill.drafts.registry import Card, register_kind
from specdistill.models.vocab import frequent_token_vocab, restrict_to_draft_vocab
from specdistill.moe.draft import init_eagle3_from_config
from specdistill.tensors import pad_rows, shift_left, unwrap
from specdistill.tokens import check_vocab_compatible

from .drafter import Eagle3Drafter
from .export import FORMATS, MIDLAYER_ARCH, SPECULATORS_ARCH, export_eagle3, validate_export
from .model import ChainQuery, Eagle3Head, build_eagle3, default_aux_layer_ids
from .readback import check_eagle3_head


def describe_folder(config: dict) -> Optional[str]:
    """An EAGLE-3 head's folder (ours, vLLM's or speculators' format, or another tool's), from its config.json: they
    declare a Llama or Qwen3 model_type, so AutoModelForCausalLM would load them as that LM with random layers."""
    archs = [str(a) for a in config.get("architectures") or []]
    if not (any("eagle" in a.lower() for a in archs) or "eagle_config" in config
            or config.get("speculators_model_type") or "draft_vocab_size" in config):
        return None
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
    reduced = (f" with a reduced vocabulary ({draft_vocab} of {vocab} tokens)"
               if draft_vocab and vocab and draft_vocab != vocab else "")
    return f"an EAGLE-3 head{reduced} (architectures {archs})"


@register_kind(name="eagle3", inits={"eagle3": ("intermediate_size",)}, path_inits=("eagle3",),  # path: a warm start
               num_layers=1,               # the one-layer layout vLLM and SGLang load
               decodes_alone=False,        # every token it conditions on needs the target's hidden states
               needs_data_to_build=True,   # its vocabulary is the training data's most frequent next tokens
               data_objective="eagle3",    # its data loss is the training-time-test unroll, not a token-level KD
               card=Card("An EAGLE-3 head", library="specdistill", tags=("eagle3",)),
               exporters={fmt: export_eagle3 for fmt in FORMATS}, validator=validate_export,
               export_architectures=(MIDLAYER_ARCH, SPECULATORS_ARCH), fits=check_eagle3_head,
               describe_folder=describe_folder)
class Eagle3Draft(DraftAdapter):
    """An Eagle3Head on the target's aux hidden states: q over its draft vocabulary (Vd), mapped to target ids."""

    ARCHITECTURE = MIDLAYER_ARCH  # config.json architectures of a saved head (midlayer format)

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        return isinstance(model, Eagle3Head)

    @classmethod
    def build(cls, draft_cfg, target, data) -> torch.nn.Module:
        return build_eagle3_draft(draft_cfg, target, data)

    @classmethod
    def saved_in(cls, path) -> bool:
        cfg_file = Path(path) / "config.json"
        return cfg_file.exists() and cls.ARCHITECTURE in json.loads(cfg_file.read_text()).get("architectures", [])

    @classmethod
    def load(cls, path) -> torch.nn.Module:
        return Eagle3Head.from_pretrained(path)

    @classmethod
    def unreadable(cls, path) -> Optional[str]:
        try:
            raw = json.loads((Path(path).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None  # the loaders say what is missing
        if SPECULATORS_ARCH in (raw.get("architectures") or []):
            return (f"{path} is a speculators-format export ({SPECULATORS_ARCH}), which specdistill does not load: "
                    "evaluate the checkpoint's draft/ folder it was exported from, or an export made with --format "
                    "vllm")
        return None

    @classmethod
    def warm_start_overrides(cls, path) -> list[str]:
        return ["draft=eagle3", f"draft.path={path}"]

    @classmethod
    def prepare_target(cls, target) -> None:
        """Before the target decodes for regeneration: it must return the head's aux hidden states."""
        if not target.aux_layer_ids:
            target.set_aux_layer_ids(default_aux_layer_ids(target.config.num_hidden_layers))

    def drafter(self, confidence: float = 0.0) -> Drafter:
        return Eagle3Drafter(self.module, confidence=confidence)

    def check_target(self, target_model, why: str) -> None:
        check_vocab_compatible(self.module.config.vocab_size, logits_dim(target_model), why, what="EAGLE-3 head")

    def max_positions(self) -> Optional[int]:
        return self.module.config.max_position_embeddings

    def check_prompts(self, prompt_mask: torch.Tensor) -> None:
        if int(prompt_mask.sum(1).min()) < 2:
            raise ValueError("EAGLE-3 rollouts need prompts of at least 2 tokens (the head drafts from the target's "
                             "features of the token before the pending one)")

    def row_feature_layers(self) -> Optional[list[int]]:
        return list(self.module.config.aux_layer_ids)

    def logits_at(self, rows, row, context_len, index, features, pad_id: int, shares=None,
                  feature_row=None) -> torch.Tensor:
        return eagle3_logits_at(self.model, rows, features, row, context_len, index, pad_id, shares, feature_row)

    def restrict(self, p_logits: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return restrict_to_draft_vocab(p_logits, self.module.t2d)

    def alpha(self, p_logits, q_logits, temperature: float, q_temperature=None) -> torch.Tensor:
        return min_sum_on_draft_vocab(p_logits, q_logits, self.module.t2d, temperature, q_temperature)

    def chain_counts(self, target_out, batch: dict, gamma: int) -> torch.Tensor:
        return eagle3_chain_counts(self.model, target_out, batch, gamma)

    @classmethod
    def card_section(cls, repo_id: str, target: str, exports: list[str], gamma: int) -> str:
        v = "serving/vllm" if "vllm" in exports else "<export with scripts/export.py --format vllm>"
        s = "serving/sglang" if "sglang" in exports else "<export with scripts/export.py --format sglang>"
        return f"""This is an EAGLE-3 head. The repository root holds specdistill's own format (warm starts,
evaluation); the serving engines read the exports in `serving/` (SGLang numbers aux layers one lower than vLLM, so use
its own folder).

```bash
huggingface-cli download {repo_id} --local-dir draft
# vLLM
vllm serve {target} \\
    --speculative-config '{{"method": "eagle3", "model": "draft/{v}", "num_speculative_tokens": {gamma}}}'
# SGLang
python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path draft/{s} --speculative-num-steps {gamma} --speculative-eagle-topk 1 \\
    --speculative-num-draft-tokens {gamma + 1}
```
"""


def build_eagle3_draft(draft_cfg, target, data):
    """An EAGLE-3 head for `target`; sets the target to return the head's aux hidden states from its forward."""
    if draft_cfg.path:
        head = Eagle3Head.from_pretrained(draft_cfg.path)
        check_eagle3_head(head, draft_cfg.path, target.model)  # its shapes; an export's missing embeddings
        check_vocab_compatible(head.config.vocab_size, target.config.vocab_size, "warm-start only from a head "
                               "trained for this target", what=f"EAGLE-3 head at {draft_cfg.path}")
        width = draft_cfg.intermediate_size
        if width is not None and width != head.config.intermediate_size:
            raise ValueError(f"draft.intermediate_size={width} but the head at {draft_cfg.path} has "
                             f"{head.config.intermediate_size}: a warm start keeps the head's shape; drop "
                             "draft.intermediate_size (or set it to the checkpoint's) or train a fresh head")
    else:
        V, Vd = target.config.vocab_size, draft_cfg.draft_vocab_size
        if Vd is not None and Vd > V:
            raise ValueError(f"draft.draft_vocab_size={Vd} is larger than the target's vocabulary ({V} tokens): set "
                             f"draft.draft_vocab_size to at most {V}, or null for the whole vocabulary")
        vocab = frequent_token_vocab(data.train, V, V if Vd is None else Vd)
        head = build_eagle3(target.model, vocab, target.aux_layer_ids, draft_cfg.output_from_target,
                            draft_cfg.intermediate_size)
        if draft_cfg.moe.eagle3_mlp:  # MoE targets: the MLP starts as a merge of hot experts (specdistill/moe)
            init_eagle3_from_config(head, draft_cfg, target.model, data)
    target.set_aux_layer_ids(head.config.aux_layer_ids)
    return head.train()


def eagle3_logits_at(head, rows: list[torch.Tensor], aux: torch.Tensor, row: torch.Tensor, context_len: torch.Tensor,
                     index: torch.Tensor, pad_id: int, shares: Optional[list[int]] = None,
                     feature_row: Optional[list[int]] = None) -> torch.Tensor:
    """(P, Vd) the head's draft-vocabulary logits at each drafted position, WITH grad: drafted position p is step
    index[p] of the TTT unroll at slot context_len - index - 2 of its row (module docstring). head: the Eagle3Head,
    bare or inside a DDP / DeepSpeed wrapper (called through its forward).

    Sparse (Eagle3Head.unroll_chains): step 0 runs over every slot of the rows that carry a context (its keys are
    what the drafting steps attend to); the later steps only along chains, one per (row, drafting slot) read.
    shares (R,): row r's tokens and features equal row shares[r]'s up to each of its drafting slots + 1 (a branch row
    and its trajectory), so its chains run on that row's step 0 with their own tokens: a branch costs its chain's
    steps, not a forward over its whole length. Checked on the tokens. The lm_head runs on the P read states only.
    feature_row (R,): the row of aux that row r reads (None: its own); only the base rows' features are read."""
    device = aux.device
    steps = int(index.max()) + 1
    slot = context_len - index - 2                                             # (P,) drafting slot of each one
    base = row if shares is None else torch.as_tensor(shares, dtype=torch.long, device=row.device)[row]  # (P,)
    # chains: one per (row, slot); grouped by the base row whose step 0 they read
    key = (row * (int(slot.max()) + 1) + slot).tolist()
    chain_of: dict[int, int] = {}
    chains: list[tuple[int, int, int]] = []                                    # (row, slot, base)
    for k, r, s, b in zip(key, row.tolist(), slot.tolist(), base.tolist()):
        if k not in chain_of:
            chain_of[k] = len(chains)
            chains.append((r, s, b))
    bases = sorted({b for _, _, b in chains})
    base_at = {b: i for i, b in enumerate(bases)}
    need = {b: 0 for b in bases}                                               # tokens step 0 needs per base row
    per_base: list[list[int]] = [[] for _ in bases]
    for c, (r, s, b) in enumerate(chains):
        need[b] = max(need[b], s + 2)
        per_base[base_at[b]].append(c)
        if r != b and not torch.equal(rows[r][: s + 2], rows[b][: s + 2]):
            raise ValueError(f"eagle3_logits_at: shares[{r}] = {b}, but the rows' tokens differ before slot {s + 2}")
    ids, mask = pad_rows([rows[b][: need[b]] for b in bases], pad_id, side="right", device=device)  # (Rb, Lb)
    Lb = ids.shape[1]
    feats = aux[feature_rows(bases, feature_row, device), :Lb]                  # (Rb, Lb, D)
    if feats.shape[1] < Lb:
        feats = torch.cat([feats, feats.new_zeros(len(bases), Lb - feats.shape[1], feats.shape[2])], dim=1)
    # the later steps run over groups of at most C chains, each on one base row: a base row with many chains (a
    # rollout trajectory) spans several groups, one with few (a replayed context) fills one, instead of every row
    # padded to the busiest row's count
    C = group_size([len(cs) for cs in per_base], Lb) if steps > 1 else max(len(cs) for cs in per_base)
    groups = [(bi, cs[i: i + C]) for bi, cs in enumerate(per_base) for i in range(0, len(cs), C)]
    chain_slot = torch.zeros(len(groups), C, dtype=torch.long, device=device)  # padding chains: slot 0, ignored
    chain_tok = torch.full((len(groups), C, max(steps - 1, 0)), pad_id, dtype=torch.long, device=device)
    where = [(0, 0)] * len(chains)                                             # chain -> (group, column)
    for gi, (_, cs) in enumerate(groups):
        for ci, c in enumerate(cs):
            r, s, _ = chains[c]
            chain_slot[gi, ci] = s
            t = rows[r][s + 2: s + 1 + steps]                                  # tokens read at steps 1 .. steps-1
            chain_tok[gi, ci, : len(t)] = t
            where[c] = (gi, ci)
    at = torch.tensor([where[chain_of[k]] for k in key], dtype=torch.long, device=device)  # (P, 2)
    read = torch.cat([index[:, None].to(device), at], dim=1)                  # (P, 3): step, group, column
    group_row = None if len(groups) == len(bases) else torch.tensor([bi for bi, _ in groups], device=device)
    # through the (possibly DDP / DeepSpeed-wrapped) module's forward, so its gradients are synced across ranks
    return head(feats, ids, mask, chains=ChainQuery(chain_slot, chain_tok, read, group_row))  # (P, Vd)


def eagle3_chain_counts(head, target_out, batch: dict, gamma: int) -> torch.Tensor:
    """EAGLE-3 heads: unroll gamma steps on the head's own features (as the TTT objective does); a chain started at
    slot t reaches k if steps 0..k-1 all predict the target's argmax for tokens t+2..t+1+k. Same counts as above."""
    lm = batch["loss_mask"].bool()
    step_logits = head(target_out.aux_hidden, batch["input_ids"], batch["attention_mask"], steps=gamma)
    inner = unwrap(head)
    target_argmax = target_out.logits.argmax(-1)  # (B, T)
    ok = shift_left(lm, 1)  # chains start at slots whose first prediction is a loss position
    reached = [ok.sum()]
    for j, q in enumerate(step_logits):
        hit = inner.draft_to_target(q.argmax(-1)) == shift_left(target_argmax, 1 + j, fill=-1)
        ok = ok & hit & shift_left(lm, 1 + j, fill=False)
        reached.append(ok.sum())
    return torch.stack(reached)
