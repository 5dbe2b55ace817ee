"""Draft-OPD (arXiv 2605.29343): on-policy distillation of the draft on its own target-assisted speculative rollouts,
with replay of rejected positions and an acceptance-weighted loss.

Per call (one micro-batch), in order:
  1. Rollout (no grad, draft in eval mode): the batch's prompts are decoded by real speculative decoding with the
     current draft (onpolicy/rollout.py, the evaluator's decoding/ code); every drafted position is kept with its
     context, the target's logits there, the verifier's decision and its category. Refreshed every `rollout_every`
     calls.
  2. Replay: `replay_ratio` x (fresh positions) of the worst-missed earlier rejections (each round's first rejected
     draft; the drafts after it were never verified) come back from the buffer
     (onpolicy/replay.py) with their cached target logits; the current draft re-scores them and their priority
     (1 - alpha) is updated. Replayed contexts that are prefixes of one another share one row (pack_prefixes).
  3. Loss (with grad): ONE draft forward over the rows holding every position's context; per position a divergence
     D(p || q) (or a weighted mix) between the target's and the draft's next-token distributions, weighted by
     `weighting` (onpolicy/weights.py): reach = prod_{j<i} alpha_j (detached), decay, or none. Replayed positions
     weigh `replay_weight`. Optional: kd_weight x the same divergence on the data batch's loss tokens (off-policy mix).

Positions after the first rejection of a round (off_trajectory=branch): their context contains the rejected draft,
so it is NOT a prefix of the final trajectory. Each such round adds one "branch" row (trajectory up to the accepted
drafts + the round's drafts); the draft runs on it with grad like on any other row, so every position is trained on
exactly the context it was proposed in. Extra draft compute for an LM draft: one row per round with a rejection
before its last draft (about rounds x context tokens); an EAGLE-3 head runs its step 0 once per trajectory and a
branch costs only its round's drafting steps (drafts/eagle3/adapter.py: eagle3_logits_at with `shares`).
off_trajectory=drop skips those positions instead.

Normalisation: the loss is a mean over positions (fresh + replayed + data tokens when kd_weight > 0). That count is
known only after the rollout, so steps 1-2 are `prepare()` (objectives/base.py's protocol), the count is
`num_tokens(prepared)` and `num_tokens_before_prepare` is None: the loop then prepares and backpropagates one
micro-batch at a time and rescales the gradients by the step's global count after the last backward
(train/loop.py: accumulate). The replay buffer's updates of a step's micro-batches (priorities, new rejections) wait
for end_step(), so every micro-batch of a step samples the buffer as it was when the step began, whatever the split.

Token trees (objective.tree_topk > 0): rollouts decode with trees through the evaluator's decoder (a tree shape as
decoding.speculative_generate's strategy); every context of a tree (the root and each node with a child: the accepted
path, the rejected siblings and the nodes under them) is one position, trained on its own context (off-path ones on
branch rows), weighted by reach, the probability that verification reaches its node (onpolicy/positions.py,
tree_opd_loss below).

Config and state: DraftOPDObjective's fields mirror conf/objective/draft_opd.yaml; everything a run accumulates
(replay buffer, counters, the rollout RNG, a cached rollout, the prompt cursor) is a DraftOPDState (`objective.state`)
with state_dict() / load_state_dict().

EAGLE-3 heads (draft=eagle3): rollouts through Eagle3Drafter; the loss forward is the head's training-time-test
unroll on its own features at each round's drafting slot, branch rows and replayed positions included
(drafts/eagle3/adapter.py: a replayed position carries its trajectory's cached target features). For a head the
kd_weight term is recipe eagle3's own loss on the data batch (objectives/eagle3.py: the TTT unroll over gamma steps).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from specdistill.constraints import bounded, check_fields, one_of
from specdistill.data.prompts import load_prompts
from specdistill.decoding import CacheMode
from specdistill.drafts import draft_adapter
from specdistill.drafts.base import decoding_precision
from specdistill.losses import DIVERGENCES, divergence
from specdistill.objectives.eagle3 import Eagle3Objective
from specdistill.objectives.base import Models, Objective, StepOutput, keep_positions, masked_logits
from specdistill.onpolicy.replay import ReplayBuffer, ReplayItem, pack_prefixes
from specdistill.onpolicy.positions import (CATEGORIES, FIRST_REJECTED, DraftedPositions, TargetLogits,
                                           split_trajectories)
from specdistill.onpolicy.rollout import collect_rollout, left_pad, prompts_from_batch
from specdistill.onpolicy.weights import WEIGHTINGS, position_weights, tree_reach_weights
from specdistill.decoding import DRAFT_POLICIES, draft_temperature
from specdistill.decoding.kv import max_positions
from specdistill.decoding.tree import TreeShape
from specdistill.tensors import block_rows, unwrap, unwrap_target
from specdistill.tokens import eos_ids, pad_id

OFF_TRAJECTORY = ("branch", "drop")


def parse_divergence(spec: str) -> list[tuple[str, float]]:
    """'fkl' -> [('fkl', 1.0)]; a mix 'rkl:1.0,tvd:0.5' -> [('rkl', 1.0), ('tvd', 0.5)]."""
    out = []
    for part in str(spec).split(","):
        name, _, w = part.strip().partition(":")
        if name not in DIVERGENCES:
            raise ValueError(f"objective.divergence={spec!r}: {name!r} is not one of {DIVERGENCES} (a mix is written "
                             "'rkl:1.0,tvd:0.5')")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            raise ValueError(f"objective.divergence={spec!r}: weight {w!r} of {name} is not a number") from None
        if weight < 0:
            raise ValueError(f"objective.divergence={spec!r}: weights must be >= 0")
        out.append((name, weight))
    return out


@dataclass
class _BufferUpdate:
    """What one micro-batch's loss() has for the replay buffer, applied at end_step(): the replayed positions' new
    priorities, and (a refreshed rollout) its rejected positions with their cached target logits."""
    replayed: list[int]                 # uids of the replayed positions
    replayed_priority: torch.Tensor     # (Q,) 1 - alpha under the current draft
    add: Optional[dict] = None          # ReplayBuffer.add's arguments, or None


@dataclass
class DraftOPDState:
    """Draft-OPD's runtime state, apart from its config: what a resumed run must restore to continue exactly
    (state_dict), and caches rebuilt on use (the prompt list, the draft check)."""
    buffer: ReplayBuffer
    calls: int = 0                  # objective calls (micro-batches) so far
    refreshes: int = 0              # rollouts collected so far (the replay buffer's clock)
    target_tokens_total: int = 0    # tokens the target ran forwards over in rollouts (compute accounting)
    fresh: Optional[DraftedPositions] = None  # the current rollout (served rollout_every calls)
    prompt_pos: int = 0             # cursor into objective.prompts
    generator: Optional[torch.Generator] = None          # the rollout RNG, made on the rollout's device
    generator_state: Optional[torch.Tensor] = None       # from a checkpoint, applied when the generator is made
    pending: list[_BufferUpdate] = field(default_factory=list)  # this step's buffer updates (end_step applies them)
    checked: bool = False
    prompt_ids: Optional[list[torch.Tensor]] = None
    # rollout_scope=step: the step's rollout split per micro-batch, served in order (empty between steps, so never
    # in a checkpoint); step_new: its first share has not been served yet
    step_shares: list[DraftedPositions] = field(default_factory=list)
    step_new: bool = False

    def rollout_generator(self, device, seed: int) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(seed)
            if self.generator_state is not None:  # resumed: continue the saved stream
                self.generator.set_state(self.generator_state)
                self.generator_state = None
        return self.generator

    def state_dict(self) -> dict:
        """The replay buffer, the cached rollout (rollout_every > 1), the counters, the rollout RNG and the prompt
        cursor. Saved per rank by train/checkpoint.py (pickled; tensors as they are, moved back to the batch's device
        on use). Checkpoints are written between steps, when nothing is pending."""
        return {"buffer": self.buffer, "calls": self.calls, "refreshes": self.refreshes,
                "target_tokens_total": self.target_tokens_total, "fresh": self.fresh,
                "generator": None if self.generator is None else self.generator.get_state(),
                "prompt_pos": self.prompt_pos}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = state["buffer"]
        self.calls, self.refreshes = state["calls"], state["refreshes"]
        self.target_tokens_total, self.prompt_pos = state["target_tokens_total"], state["prompt_pos"]
        self.fresh = state["fresh"]
        self.generator_state = state["generator"]  # applied when the generator is made on the rollout's device
        self.generator = None
        self.pending = []


@dataclass
class _Prepared:
    """One micro-batch after prepare(): its rollout positions, the replayed ones, and the loss-token count."""
    batch: dict
    fresh: DraftedPositions
    replay: list[ReplayItem]
    add_to_buffer: bool           # this call refreshed the rollout: its rejected positions enter the buffer
    metrics: dict
    num_tokens: torch.Tensor


@dataclass
class DraftOPDObjective(Objective):
    target_calls_depend_on_data = True  # rollouts (not a config field: no annotation)
    name: str = "draft_opd"
    # rollouts (specdistill/onpolicy/rollout.py)
    gamma: int = bounded(4, ">= 1")  # drafts per round
    max_new_tokens: int = bounded(64, ">= 2")  # rollout length per prompt (at least one drafted round)
    # rollout sampling temperature of draft and target (0 = greedy verification)
    temperature: float = bounded(1.0, ">= 0")
    # T > 0: greedy = argmax drafts verified one-hot (the engines') | sample (d ~ q)
    draft_policy: str = one_of("greedy", DRAFT_POLICIES)
    assist: bool = True                 # false: the draft decodes alone, the target scores afterwards (ablation)
    # a rollout serves this many calls (micro-batches) before it is refreshed
    rollout_every: int = bounded(1, ">= 1")
    # micro_batch: each micro-batch decodes its own prompts | step: the prompts of all of an optimizer step's
    # micro-batches decode together in one rollout (more rows per verify forward, which costs about the same for 4 rows
    # as for 16 where reading the weights bounds it), split back so each micro-batch trains on its own rows. The draft
    # is the same for every micro-batch of a step, so what is trained is unchanged; all the step's rollouts are resident
    # at once. Needs rollout_every=1
    rollout_scope: str = one_of("micro_batch", ("micro_batch", "step"))
    max_prompt_tokens: Optional[int] = bounded(512, ">= 1")  # longer prompts keep their last tokens
    # null: each data row's own prompt (up to its first assistant turn; a row without one is all prompt). Else a
    # prompt-only source, as eval.prompts: a .json/.jsonl/.parquet file or hub dataset of prompt / messages /
    # conversations / turns rows, embedded:sharegpt, ...; read once (prompts over max_prompt_tokens skipped), cycled
    # in order, one prompt per batch row. The data batches then only pace the loop (and feed kd_weight).
    prompts: Optional[str] = None
    # branch: train positions after a rejection on their own context | drop
    off_trajectory: str = one_of("branch", OFF_TRAJECTORY)
    # keep the target's top-k logits per position (0 = the full distribution)
    target_top_k: int = bounded(0, ">= 0")
    # loss
    divergence: str = "fkl"             # fkl | rkl | jsd | tvd | acceptance, or a mix 'rkl:1.0,tvd:0.5'
    beta: float = bounded(0.5, "[0, 1]")  # jsd only
    # temperature of both distributions inside the divergence (and of priorities)
    loss_temperature: float = bounded(1.0, "> 0")
    weighting: str = one_of("reach", WEIGHTINGS)  # reach (prod_{j<i} alpha_j) | decay | none
    # weighting=decay: k-th position after the first rejection weighs decay^k
    decay: float = bounded(0.9, "(0, 1]")
    # replay (specdistill/onpolicy/replay.py)
    replay: bool = True
    replay_ratio: float = bounded(0.25, "[0, 1]")  # replayed positions per call = replay_ratio x fresh positions
    replay_capacity: int = bounded(2048, ">= 1")  # positions kept
    # rollout refreshes an item may age before it is dropped (null = no limit)
    replay_max_age: Optional[int] = bounded(50, ">= 0")
    # loss weight of a replayed position (1.0 measured worse: docs/results.md)
    replay_weight: float = bounded(0.25, ">= 0")
    # off-policy mix: + kd_weight x divergence on the data batch's loss tokens (heads: eagle3's loss)
    kd_weight: float = bounded(0.0, ">= 0")
    seed: int = 0                       # rollout sampling
    # rollouts decode token trees when tree_topk > 0 (gamma unused): each round grows the draft's tree_topk best
    # children per beam for tree_depth steps, keeping the tree_nodes best (0: all; decoding/tree.py, as eval.tree).
    # The loss trains every context of each tree (the accepted path, the rejected siblings and the nodes under them),
    # weighed by the probability that verification reaches it (weighting=reach) or 1 (none)
    tree_topk: int = bounded(0, ">= 0")
    tree_depth: int = bounded(4, ">= 1")
    tree_nodes: int = bounded(0, ">= 0")

    def __post_init__(self):
        check_fields(self, "objective")  # the ranges and choices on the fields above
        self.mix = parse_divergence(self.divergence)
        self._check_tree()
        if self.rollout_scope == "step" and self.rollout_every > 1:
            raise ValueError(f"objective.rollout_scope=step decodes each optimizer step's prompts once, for its own "
                             f"micro-batches; objective.rollout_every={self.rollout_every} reuses one rollout over "
                             "several micro-batches instead. Set objective.rollout_every=1, or rollout_scope="
                             "micro_batch")

    def tree_shape(self) -> Optional[TreeShape]:
        """The rollouts' token-tree shape; None: chains of gamma drafts (objective.tree_topk=0)."""
        if self.tree_topk == 0:
            return None
        try:
            return TreeShape(self.tree_topk, self.tree_depth, self.tree_nodes or None)
        except ValueError as e:
            raise ValueError(f"objective.tree_topk/tree_depth/tree_nodes: {e}") from None

    def _check_tree(self) -> None:
        if self.tree_shape() is None:
            return
        if self.weighting == "decay":
            raise ValueError("objective.weighting=decay counts positions after a chain's first rejection; token-tree "
                             "rollouts (objective.tree_topk > 0) weigh by reach (the probability that verification "
                             "reaches each node) or none")
        if not self.assist:
            raise ValueError("token-tree rollouts (objective.tree_topk > 0) are verified by the target: keep "
                             "objective.assist=true, or set objective.tree_topk=0 for the draft-only ablation")
        if self.draft_policy == "sample" and self.temperature > 0:
            raise ValueError("token-tree rollouts propose each node's top-k children: use objective.draft_policy="
                             "greedy with objective.tree_topk > 0")

    @property
    def state(self) -> DraftOPDState:
        """The run's state (made at first use; not a dataclass field, so the fields stay the YAML's mirror)."""
        state = self.__dict__.get("_state")
        if state is None:
            state = self.__dict__["_state"] = DraftOPDState(ReplayBuffer(self.replay_capacity, self.replay_max_age))
        return state

    # ------------------------------------------------------------------------------------------- the protocol
    def prepare(self, batch: dict, models: Models) -> _Prepared:
        """Steps 1-2 (no grad): the rollout (refreshed every rollout_every calls, or this micro-batch's share of the
        step's rollout) and the replayed positions."""
        return self._prepare(batch, models)

    @torch.no_grad()
    def prepare_step(self, micro: list[dict], models: Models) -> None:
        """rollout_scope=step: one rollout over the prompts of all the step's micro-batches, split back per
        micro-batch (onpolicy/positions.py: split_trajectories); prepare() then serves each its own share."""
        if self.rollout_scope != "step" or len(micro) < 2:
            return
        draft, target = unwrap(models.draft), unwrap_target(models.target)
        self._check_once(draft, target)
        sizes = [int(b["input_ids"].shape[0]) for b in micro]
        rollout = self._rollout(micro, models, draft, target)
        self.state.step_shares, self.state.step_new = split_trajectories(rollout, sizes), True

    def check_draft_kind(self, kind) -> None:
        if not self.assist and not kind.decodes_alone:
            raise ValueError(f"objective.assist=false (draft-only rollouts) needs a draft that decodes alone; a "
                             f"{kind.kind} draft conditions every token on the target's hidden states, so it cannot. "
                             "Keep objective.assist=true for it, or ablate assistance on a standalone LM draft "
                             "(draft=pretrained / draft=from_target)")

    def num_tokens_before_prepare(self, batch: dict) -> None:
        """Unknown before the rollout: the loop counts after prepare() (num_tokens) and rescales the gradients."""
        return None

    def num_tokens(self, prepared: _Prepared) -> torch.Tensor:
        """() loss positions loss(prepared) returns: fresh + replayed (+ the data's loss tokens when kd_weight > 0)."""
        return prepared.num_tokens

    def loss(self, prepared: _Prepared, models: Models) -> StepOutput:
        prep, batch = prepared, prepared.batch
        fresh, replay = prep.fresh, prep.replay
        P, device = len(fresh), fresh.row.device

        # 1-2. Per-position loss (with grad) and, detached, alpha at the rollout temperature (reach weights) and
        #      at the loss temperature (replay priorities; soft at any decoding temperature).
        loss, alpha_roll, priority = self._score(fresh, replay, models)                        # (P + Q,) each
        with torch.no_grad():
            weight_fresh = (tree_position_weights(self.weighting, fresh) if fresh.parent is not None else
                            position_weights(self.weighting, alpha=alpha_roll[:P], category=fresh.category,
                                             round_id=fresh.round_id, index=fresh.index, decay=self.decay))
            weight = torch.cat([weight_fresh, torch.full((len(replay),), self.replay_weight, device=device)])
            update = _BufferUpdate([it.uid for it in replay], priority[P:])
            if prep.add_to_buffer and self.replay:
                # The positions verification rejected: each round's first rejected draft. Later drafts of the round
                # were discarded unverified (their context holds the rejected token, off the trajectory, and their
                # reach weight is ~0); replaying them at replay_weight would undo the acceptance weighting.
                missed = (fresh.category == FIRST_REJECTED).nonzero().flatten()
                features = {}
                if fresh.aux is not None:  # the target's features, once per trajectory (a branch reads its own's)
                    src = [fresh.source[r] for r in fresh.row[missed].tolist()]
                    traj = {s: fresh.aux[s, : len(fresh.rows[s])].clone() for s in set(src)}
                    features = {"aux": [traj[s] for s in src], "index": fresh.index[missed].tolist()}
                update.add = dict(contexts=fresh.contexts(missed), targets=fresh.target.select(missed),
                                  priorities=priority[:P][missed].cpu(), **features)
            self.state.pending.append(update)

        # Every rank reports the same metric keys whatever its data (an empty replay sample, a batch without loss
        # tokens): the loop reduces the metrics as one stacked tensor across ranks.
        metrics = dict(prep.metrics)
        losses, weights = [loss], [weight]
        # 3. Off-policy mix: the same divergence on the data batch's own loss tokens (a second draft forward).
        if self.kd_weight > 0:
            metrics["kd_loss_sum"] = metrics["kd_loss_count"] = torch.zeros((), device=device)
            if bool(batch["loss_mask"].any()):
                term = OFF_POLICY[draft_adapter(models.draft).spec.data_objective]
                kd, kd_w = term.loss(self, batch, models)                                       # (N,) each
                losses.append(kd)
                weights.append(kd_w.detach())
                metrics["kd_loss_sum"] = kd.detach().sum()
                metrics["kd_loss_count"] = torch.tensor(float(kd.numel()), device=device)

        with torch.no_grad():
            f = lambda x: torch.as_tensor(float(x), device=device)  # noqa: E731
            metrics["loss_sum"] = sum((l * w).sum() for l, w in zip(losses, weights)).detach()
            metrics["onpolicy_loss_sum"], metrics["onpolicy_loss_count"] = loss[:P].detach().sum(), f(P)
            metrics["weight_sum"], metrics["weight_count"] = weight_fresh.sum(), f(P)
            metrics["alpha_sum"], metrics["alpha_count"] = (1 - priority[:P]).sum(), f(P)
            for c, name in enumerate(CATEGORIES):
                metrics[f"frac_{name}_sum"], metrics[f"frac_{name}_count"] = (fresh.category == c).sum().float(), f(P)
            if self.replay:
                metrics["replay_used_sum"], metrics["replay_used_count"] = f(len(replay)), f(1)
                metrics["replay_loss_sum"], metrics["replay_loss_count"] = loss[P:].detach().sum(), f(len(replay))
        return StepOutput(torch.cat(losses), torch.cat(weights), metrics)

    def end_step(self) -> dict:
        """After the step's last micro-batch: the replay buffer takes each micro-batch's updates in order (new
        priorities, then its rejected positions, all at the step's clock); per micro-batch, the buffer's size and
        priorities after its update are the metrics (detached sums)."""
        state, metrics = self.state, {}
        for u in state.pending:
            if u.replayed:
                state.buffer.update(u.replayed, u.replayed_priority)
            if u.add is not None:
                state.buffer.add(now=state.refreshes, **u.add)
            if self.replay:
                device = u.replayed_priority.device
                f = lambda x, device=device: torch.as_tensor(float(x), device=device)  # noqa: E731
                pr = state.buffer.priorities()
                for k, v in {"replay_size_sum": f(len(state.buffer)), "replay_size_count": f(1),
                             "replay_priority_sum": f(pr.sum()), "replay_priority_count": f(len(pr))}.items():
                    metrics[k] = metrics[k] + v if k in metrics else v
        state.pending = []
        return metrics

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """What a resumed run needs to continue exactly as an uninterrupted one (DraftOPDState.state_dict)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)

    # ------------------------------------------------------------------------------------------- internals
    def _score(self, fresh: DraftedPositions, replay: list[ReplayItem], models: Models):
        """ONE draft forward over every context row (rollout rows, branches, replayed contexts) -> per-position
        loss (P + Q,) with grad, and detached alpha at the rollout temperature and 1 - alpha at the loss one."""
        draft = draft_adapter(models.draft)
        device, pad = fresh.row.device, pad_id(models.tokenizer)
        # the target's full logits in two parts, fresh (P, V) and replayed (Q, V), never concatenated: everything
        # below reads them row by row, and a (P + Q, V) copy would be the step's largest tensor at long rollouts
        parts = [fresh.target.to(device).dense()]
        if replay:
            parts.append(TargetLogits.cat([it.target.to(device) for it in replay]).dense())
        features = fresh.aux is not None  # the target's features (EAGLE-3, DFlash): one tensor per trajectory
        keys = [id(it.aux) for it in replay] if features else None
        replay_rows, row_of = pack_prefixes([it.context.to(device) for it in replay], keys)  # shared prefixes: one row
        rows = fresh.rows + replay_rows
        row = torch.cat([fresh.row, torch.tensor(row_of, dtype=torch.long, device=device) + len(fresh.rows)])
        ctx = torch.cat([fresh.context_len,
                         torch.tensor([len(it.context) for it in replay], dtype=torch.long, device=device)])
        index = torch.cat([fresh.index, torch.tensor([it.index for it in replay], dtype=torch.long, device=device)])
        # a branch row agrees with its trajectory up to its round's start (positions.py); a replayed row is its own
        source = list(fresh.source) if fresh.source is not None else list(range(len(fresh.rows)))
        shares = source + list(range(len(fresh.rows), len(rows)))
        aux, feature_row = None, None
        if features:
            row_aux = {r: replay[k].aux for k, r in enumerate(row_of)}  # a replayed row's trajectory features
            aux = _stack_aux(fresh.aux.to(device), [row_aux[r] for r in range(len(replay_rows))],
                             max(len(r) for r in rows))                                          # (B + Rq, L, D)
            B = fresh.aux.shape[0]
            feature_row = source + list(range(B, B + len(replay_rows)))                           # (R + Rq,)
        q_logits = draft.logits_at(rows, row, ctx, index, aux, pad, shares, feature_row)         # (P + Q, Vd)
        restricted = [draft.restrict(x) for x in parts]
        p_logits = torch.cat([r[0] for r in restricted])                                             # (P + Q, Vd)
        in_vocab = None if restricted[0][1] is None else torch.cat([r[1] for r in restricted])       # (P + Q,)
        loss = self._divergence(p_logits, q_logits)
        if in_vocab is not None:  # target argmax outside the draft vocabulary: masked, as the eagle3 objective does
            loss = loss * in_vocab
        q_det = q_logits.detach()
        q_temperature = draft_temperature(self.draft_policy, self.temperature)  # greedy drafts: q one-hot at its argmax
        # detached, a block of rows at a time: each takes softmaxes of the full (P + Q, V) target logits, which at
        # 1024-token rollouts and a large vocabulary would otherwise hold several more copies of them at once
        def rows(fn):  # fn over each part's rows and the draft's rows beside them, a block at a time -> (P + Q,)
            q_parts = q_det.split([len(x) for x in parts])
            return torch.cat([by_row_blocks(fn, x, q) for x, q in zip(parts, q_parts)])

        return (loss, rows(lambda p, q: draft.alpha(p, q, self.temperature, q_temperature)),
                1 - rows(lambda p, q: draft.soft_alpha(p, q, self.loss_temperature)))

    def _divergence(self, p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
        return sum(w * divergence(name, p_logits, q_logits, beta=self.beta, temperature=self.loss_temperature)
                   for name, w in self.mix)

    def _check_draft(self, draft, target) -> None:
        if _sharded(draft):
            raise ValueError("objective=draft_opd needs the whole draft on every rank (one process or DDP): rollouts "
                             "run a data-dependent number of draft forwards per rank, which a sharded draft (FSDP / "
                             "DeepSpeed ZeRO-3, whose forwards are collectives) cannot do without ranks hanging")
        adapter = draft_adapter(draft)
        adapter.check_target(target, "on-policy distillation compares the two distributions token by token; use a "
                             "draft with the target's tokenizer")
        if self.tree_shape() is not None and not adapter.drafter().grows_trees:
            raise ValueError(f"objective.tree_topk={self.tree_topk}: a {adapter.kind} draft cannot score alternatives "
                             "(it drafts one token per position), so it cannot grow token trees; set "
                             "objective.tree_topk=0 for chain rollouts (LM drafts and EAGLE-3 heads grow trees)")
        if self.tree_shape() is not None and not adapter.trains_on_trees:
            raise ValueError(f"objective.tree_topk={self.tree_topk}: a {adapter.kind} draft decodes token trees but "
                             "is not trained on them (a tree's contexts are not its training contexts); set "
                             "objective.tree_topk=0 for chain rollouts (LM drafts and EAGLE-3 heads train on trees)")

    @torch.no_grad()
    def _prepare(self, batch: dict, models: Models) -> _Prepared:
        draft, target = unwrap(models.draft), unwrap_target(models.target)
        state = self.state
        self._check_once(draft, target)
        device = batch["input_ids"].device
        state.calls += 1
        f = lambda x: torch.as_tensor(float(x), device=device)  # noqa: E731
        metrics: dict = {}
        shared = bool(state.step_shares)  # this micro-batch's share of the step's rollout (prepare_step)
        refresh = shared or state.fresh is None or (state.calls - 1) % self.rollout_every == 0
        new = refresh
        if shared:  # a step's rollout is new (counted, its stats logged) at its first share
            state.fresh, new, state.step_new = state.step_shares.pop(0), state.step_new, False
        elif refresh:
            state.fresh = self._rollout([batch], models, draft, target)
        if new:
            state.refreshes += 1
            s = state.fresh.stats
            state.target_tokens_total += s.target_tokens
            metrics.update({"rollout_accept_rate_sum": f(s.accepted), "rollout_accept_rate_count": f(s.drafted),
                            "rollout_tau_sum": f(s.emitted), "rollout_tau_count": f(s.target_forwards),
                            "rollout_alpha_sum": f(s.alpha), "rollout_alpha_count": f(s.drafted),
                            "rollout_target_tokens_sum": f(s.target_tokens), "rollout_target_tokens_count": f(1)})
            # accepted / proposed drafts by where in the output the round started (rollout_accept_bucket_0_127, ..):
            # the buckets a rollout of max_new_tokens can reach, so every rank logs the same keys
            for b in s.output_buckets:
                if b.start < self.max_new_tokens:
                    metrics[f"rollout_accept_bucket_{b.name}_sum"] = f(b.accepted.sum())
                    metrics[f"rollout_accept_bucket_{b.name}_count"] = f(b.proposed.sum())
        if state.fresh.row.device != device:  # a cached rollout restored from a checkpoint (loaded on CPU)
            state.fresh = _positions_to(state.fresh, device)
        fresh = state.fresh
        replay = state.buffer.sample(round(self.replay_ratio * len(fresh)), state.refreshes) if self.replay else []
        n = len(fresh) + len(replay)
        if self.kd_weight > 0:  # the data batch's loss positions (a head: one per unroll step reaching one)
            n += OFF_POLICY[draft_adapter(draft).spec.data_objective].count(self, batch["loss_mask"].bool())
        return _Prepared(batch, fresh, replay, refresh, metrics, f(n))

    def _check_once(self, draft, target) -> None:
        if not self.state.checked:
            self._check_draft(draft, target)
            self.state.checked = True

    def _rollout(self, batches: list[dict], models, draft, target) -> DraftedPositions:
        """One rollout over the prompts of `batches` (one micro-batch, or a step's), in order."""
        pad = pad_id(models.tokenizer)
        device = batches[0]["input_ids"].device
        if self.prompts:
            ids, mask = self._next_prompts(sum(b["input_ids"].shape[0] for b in batches), models, target, pad)
            ids, mask = ids.to(device), mask.to(device)
        else:
            parts = [prompts_from_batch(b, pad, self.max_prompt_tokens, context=max_positions(target),
                                        max_new_tokens=self.max_new_tokens) for b in batches]
            ids, mask = parts[0]
            if len(parts) > 1:  # each micro-batch's prompts, left-padded together
                ids, mask, _ = left_pad([r[m.bool()] for ids_, mask_ in parts for r, m in zip(ids_, mask_)], pad)
                ids, mask = ids.to(device), mask.to(device)
        generator = self.state.rollout_generator(ids.device, self.seed)
        eos = eos_ids(models.tokenizer, target, ignore_eos=False) if models.tokenizer is not None else None
        was_training = draft.training
        draft.eval()
        try:
            with decoding_precision(target):  # the draft at the target's precision; verification in fp32
                return collect_rollout(target, draft, ids, mask, gamma=self.gamma, max_new_tokens=self.max_new_tokens,
                                       temperature=self.temperature, draft_policy=self.draft_policy,
                                       assist=self.assist, eos_token_id=eos,
                                       generator=generator, pad_id=pad, top_k=self.target_top_k,
                                       branches=self.off_trajectory == "branch", tree=self.tree_shape(),
                                       cache=models.decoding or CacheMode())
        finally:
            draft.train(was_training)


    def _next_prompts(self, n: int, models: Models, target, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next n prompts of `self.prompts` (cycled), left-padded (n, T)."""
        state = self.state
        if state.prompt_ids is None:
            if models.tokenizer is None:
                raise ValueError("objective.prompts needs the target's tokenizer (its chat template) in Models")
            context = max_positions(target)
            limit = None if context is None else context - self.max_new_tokens
            if self.max_prompt_tokens is not None:
                limit = self.max_prompt_tokens if limit is None else min(limit, self.max_prompt_tokens)
            ps = load_prompts(self.prompts, models.tokenizer, num_prompts=None, max_new_tokens=self.max_new_tokens,
                              context=context, max_prompt_tokens=limit)
            state.prompt_ids = [torch.tensor(p, dtype=torch.long) for p in ps.ids]
        picked = [state.prompt_ids[(state.prompt_pos + k) % len(state.prompt_ids)] for k in range(n)]
        state.prompt_pos = (state.prompt_pos + n) % len(state.prompt_ids)
        ids, mask, _ = left_pad(picked, pad)
        return ids, mask


def tree_position_weights(kind: str, positions: DraftedPositions) -> torch.Tensor:
    """(P,) weights of a tree rollout's contexts: reach, the probability that verification reaches the context's
    node (the product of edge along its path: onpolicy/weights.py), or 1 (none). Detached."""
    if kind == "reach":
        return tree_reach_weights(positions.parent, positions.edge)
    if kind == "none":
        return torch.ones(positions.parent.shape, dtype=torch.float, device=positions.parent.device)
    raise ValueError(f"objective.weighting={kind!r} with token-tree rollouts: choose reach or none")


def tree_opd_loss(p_logits: torch.Tensor, q_logits: torch.Tensor, parent: torch.Tensor, edge: torch.Tensor,
                  div: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Draft-OPD's loss on one tree rollout's contexts, as a scalar: sum_u reach(u) D(p_u || q_u) / P.

    p_logits (P, V) the target's logits at each context (the node's row of the verify forward), q_logits (P, V) the
    draft's there (with grad); parent (P,) long, edge (P,): DraftedPositions' (onpolicy/positions.py); div(p, q) -> (P,)
    per-position divergence. reach(u) = prod of edge along u's path (detached). The objective returns the same
    terms per position (StepOutput: loss (P,), weight (P,)) and the loop divides by the global count."""
    return (div(p_logits, q_logits) * tree_reach_weights(parent, edge)).sum() / max(p_logits.shape[0], 1)


def _positions_to(p: DraftedPositions, device) -> DraftedPositions:
    """A DraftedPositions with every tensor on `device`."""
    from dataclasses import fields, replace

    moved = {}
    for f in fields(p):
        v = getattr(p, f.name)
        if isinstance(v, (torch.Tensor, TargetLogits)):
            moved[f.name] = v.to(device)
        elif isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            moved[f.name] = [t.to(device) for t in v]
    return replace(p, **moved)


def by_row_blocks(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], p: torch.Tensor, q: torch.Tensor,
                  max_elements: Optional[int] = None) -> torch.Tensor:
    """fn(p, q) -> (N,) of row-wise p (N, V), q (N, Vd), evaluated on blocks of rows of at most max_elements p values
    each (None: tensors.ROW_BLOCK_ELEMENTS of p's device type), so its temporaries never span all N rows."""
    rows = block_rows(p.shape[-1], p.device, max_elements)
    if len(p) <= rows:
        return fn(p, q)
    return torch.cat([fn(p[s: s + rows], q[s: s + rows]) for s in range(0, len(p), rows)])


def _stack_aux(fresh: torch.Tensor, replayed: list[torch.Tensor], length: int) -> torch.Tensor:
    """(B + Rq, length, D) zero-padded: the rollout's B trajectories' features, then each replayed row's trajectory
    features (slots past a trajectory's end are never read: a position reads slots <= its round's start - 1)."""
    if not replayed and fresh.shape[1] >= length:
        return fresh
    R, Lf, D = fresh.shape
    out = fresh.new_zeros(R + len(replayed), max(length, Lf), D)
    out[:R, :Lf] = fresh
    for k, a in enumerate(replayed):
        n = min(len(a), out.shape[1])
        out[R + k, :n] = a[:n].to(out.device)
    return out


def _sharded(model) -> bool:
    """FSDP (either wrapper) or ZeRO-3 parameters: the module's forward gathers shards from the other ranks."""
    if "FullyShardedDataParallel" in type(model).__name__:
        return True
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor" or hasattr(p, "ds_id"):
            return True
    return False


# ----------------------------------------------------------------------------------------------- off-policy mix
@dataclass(frozen=True)
class _OffPolicy:
    """kd_weight's term on the data batch: a data objective's per-token loss and weight (N,) each, and N."""

    loss: Callable[["DraftOPDObjective", dict, Models], tuple[torch.Tensor, torch.Tensor]]
    count: Callable[["DraftOPDObjective", torch.Tensor], int]  # loss_mask (B, T) bool -> N


def _kd_loss(obj: "DraftOPDObjective", batch: dict, models: Models) -> tuple[torch.Tensor, torch.Tensor]:
    """An LM draft: the objective's divergence on the batch's loss tokens (a second draft forward)."""
    keep = keep_positions(batch["loss_mask"])
    sel = batch["loss_mask"][:, keep].bool()
    kd_p = models.target.outputs(batch, logits_to_keep=keep).logits[sel]                   # (N, V)
    kd = obj._divergence(kd_p, masked_logits(models.draft, batch, keep))                   # (N,)
    return kd, torch.full_like(kd, obj.kd_weight)


def _ttt_loss(obj: "DraftOPDObjective", batch: dict, models: Models) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head: recipe eagle3's loss, the TTT unroll over gamma steps."""
    off = Eagle3Objective(steps=obj.gamma)(batch, models)
    return off.loss, off.weight * obj.kd_weight                                            # (N,) each


# Keyed by the objective a draft kind trains with on data (its spec's data_objective, drafts/registry.py): token-level
# KD with this objective's divergence, or recipe eagle3's TTT unroll (a head's off-policy loss: its training loss).
OFF_POLICY = {
    "kd": _OffPolicy(_kd_loss, lambda obj, lm: int(lm.sum())),
    "eagle3": _OffPolicy(_ttt_loss, lambda obj, lm: sum(int(lm[:, 1 + j:].sum()) for j in range(obj.gamma))),
}


def _block_loss(obj: "DraftOPDObjective", batch: dict, models: Models) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash draft: recipe dflash_serve's loss with blocks tiling each row (every loss token t >= 1 once)."""
    from specdistill.objectives.dflash import DFlashObjective

    off = DFlashObjective().tiled(batch, models)
    return off.loss, off.weight * obj.kd_weight                                            # (N,) each


OFF_POLICY["dflash"] = _OffPolicy(_block_loss, lambda obj, lm: int(lm[:, 1:].sum()))
