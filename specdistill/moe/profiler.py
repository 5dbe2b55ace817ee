"""Routing profiler: per MoE layer and expert, how often the router picks it and how much routing weight it gets.

Hooks on each layer's router record, in the target's ordinary forward, the top-k choice and weights it applies
(`counts`, `weight_mass`: the weights the block really multiplies the expert outputs by, i.e. after the model's
own top-k renormalisation) and the full softmax (`prob_mass`). Tokens are either the data's loss-mask positions
(`loss_mask`: positions whose next token is trained, assistant turns, shifted with the ids) or every non-padding
token (`all`). Per layer, counts sum to tokens x top_k and weight_mass to tokens (for routers that renormalise).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from specdistill.moe.routing import require_moe

TOKEN_SELECTIONS = ("loss_mask", "all")


@dataclass
class RoutingProfile:
    model_type: str
    num_experts: int  # E
    top_k: int
    layers: list[int]  # target ids of the MoE layers, in order; the per-layer lists below follow it
    counts: list[list[int]]  # (L, E) times expert e was among a token's top-k
    weight_mass: list[list[float]]  # (L, E) sum of the routing weights applied to expert e
    prob_mass: list[list[float]]  # (L, E) sum of the full softmax probability of expert e
    tokens: int  # tokens profiled (per layer)
    token_selection: str = "loss_mask"  # loss_mask | all
    source: dict = field(default_factory=dict)  # what was profiled (target path, data, ...)

    # ---------------------------------------------------------------- queries
    def row(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not an MoE layer of the profiled model (MoE layers: {self.layers})")
        return self.layers.index(layer)

    def ranked(self, layer: int) -> list[int]:
        """Experts of `layer`, most routing weight first (ties: more tokens, then lower id)."""
        r = self.row(layer)
        return sorted(range(self.num_experts), key=lambda e: (-self.weight_mass[r][e], -self.counts[r][e], e))

    def coverage(self, layer: int, experts: Iterable[int]) -> float:
        """Share of `layer`'s routing weight that lands on `experts`."""
        r = self.row(layer)
        total = sum(self.weight_mass[r])
        return sum(self.weight_mass[r][e] for e in experts) / total if total > 0 else 0.0

    def hot_experts(self, layer: int, coverage: Optional[float] = None, count: Optional[int] = None) -> list[int]:
        """The fewest most-used experts whose routing-weight share reaches `coverage`, or the `count` most used
        (exactly one of the two). Returned in ascending expert id (the order a sliced router keeps)."""
        if (coverage is None) == (count is None):
            raise ValueError("give exactly one of coverage (a share in (0, 1]) or count (a number of experts)")
        order = self.ranked(layer)
        if count is not None:
            if not 1 <= count <= self.num_experts:
                raise ValueError(f"expert count {count} must be in [1, {self.num_experts}]")
            return sorted(order[:count])
        if not 0.0 < coverage <= 1.0:
            raise ValueError(f"coverage {coverage} must be in (0, 1]")
        kept = []
        for e in order:
            kept.append(e)
            if self.coverage(layer, kept) >= coverage - 1e-9:
                break
        return sorted(kept)

    def summary(self, coverage: float = 0.9) -> list[dict]:
        """Per layer: hot experts reaching `coverage`, the share they cover, and the busiest expert's share."""
        out = []
        for layer in self.layers:
            hot = self.hot_experts(layer, coverage=coverage)
            r = self.row(layer)
            total_w = sum(self.weight_mass[r]) or 1.0
            out.append({"layer": layer, "hot_experts": hot, "num_hot": len(hot),
                        "coverage": round(self.coverage(layer, hot), 4),
                        "top1_expert": self.ranked(layer)[0],
                        "top1_share": round(max(self.weight_mass[r]) / total_w, 4),
                        "uniform_share": round(1 / self.num_experts, 4)})
        return out

    # ---------------------------------------------------------------- io
    def to_dict(self, coverage: float = 0.9) -> dict:
        return {**asdict(self), "summary_coverage": coverage, "summary": self.summary(coverage)}

    def save(self, path, coverage: float = 0.9) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(coverage), indent=1))
        return path

    @classmethod
    def load(cls, path) -> "RoutingProfile":
        d = json.loads(Path(path).read_text())
        keys = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in keys})


class RoutingRecorder:
    """Forward hooks on every router of `model`; accumulates counts and masses over the tokens selected by
    `self.token_mask` (B*T,) bool, set before each forward (None = all tokens)."""

    def __init__(self, model):
        self.blocks = require_moe(model)
        self.layers = sorted(self.blocks)
        first = self.blocks[self.layers[0]].gate
        self.num_experts, self.top_k = int(first.weight.shape[0]), int(first.top_k)
        L, E = len(self.layers), self.num_experts
        self.counts = torch.zeros(L, E, dtype=torch.long)
        self.weight_mass = torch.zeros(L, E, dtype=torch.float64)
        self.prob_mass = torch.zeros(L, E, dtype=torch.float64)
        self.tokens = torch.zeros(L, dtype=torch.long)
        self.token_mask: Optional[torch.Tensor] = None
        self._handles = []

    def __enter__(self):
        for row, layer in enumerate(self.layers):
            self._handles.append(self.blocks[layer].gate.register_forward_hook(self._hook(row)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, row: int):
        def hook(module, args, output):
            logits, weights, index = output[0], output[1], output[2]  # (N, E), (N, k), (N, k)
            if self.token_mask is not None:
                m = self.token_mask.to(index.device)
                logits, weights, index = logits[m], weights[m], index[m]
            idx = index.reshape(-1).cpu()
            self.counts[row] += torch.bincount(idx, minlength=self.num_experts)
            self.weight_mass[row].index_add_(0, idx, weights.reshape(-1).double().cpu())
            self.prob_mass[row] += torch.softmax(logits.double(), dim=-1).sum(0).cpu()
            self.tokens[row] += index.shape[0]
        return hook

    def profile(self, model_type: str, token_selection: str, source: Optional[dict] = None) -> RoutingProfile:
        return RoutingProfile(model_type=model_type, num_experts=self.num_experts, top_k=self.top_k,
                              layers=list(self.layers), counts=self.counts.tolist(),
                              weight_mass=self.weight_mass.tolist(), prob_mass=self.prob_mass.tolist(),
                              tokens=int(self.tokens[0]), token_selection=token_selection, source=source or {})


def token_mask(batch: dict, token_selection: str) -> torch.Tensor:
    """(B*T,) bool in the routers' flattened (row-major) token order."""
    if token_selection not in TOKEN_SELECTIONS:
        raise ValueError(f"token_selection={token_selection!r}: choose one of {TOKEN_SELECTIONS}")
    key = "loss_mask" if token_selection == "loss_mask" else "attention_mask"
    return batch[key].reshape(-1).bool()


@torch.no_grad()
def profile_routing(model, batches: Iterable[dict], token_selection: str = "loss_mask",
                    source: Optional[dict] = None) -> RoutingProfile:
    """Run `model` (an HF MoE causal LM) over collated batches and return its routing profile."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    with RoutingRecorder(model) as rec:
        for batch in batches:
            rec.token_mask = token_mask(batch, token_selection)
            model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                  use_cache=False, logits_to_keep=1)
    model.train(was_training)
    if int(rec.tokens[0]) == 0:
        raise ValueError(f"no tokens selected for profiling (token_selection={token_selection}): the calibration "
                         "batches carry no loss tokens; use token_selection=all or other data")
    return rec.profile(model.config.model_type, token_selection, source)


def calibration_batches(rows, pad_id: int, num_batches: int, batch_size: int = 4) -> list[dict]:
    """The first num_batches x batch_size tokenized rows ({input_ids, loss_mask}) collated into batches."""
    from specdistill.data.chat import collate

    n = min(len(rows), num_batches * batch_size)
    return [collate([rows[i] for i in range(s, min(s + batch_size, n))], pad_id) for s in range(0, n, batch_size)]


def plot_heatmap(profile: RoutingProfile, path, coverage: float = 0.9) -> Path:
    """Layers x experts heatmap of each expert's share of its layer's routing weight; hot experts outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    w = torch.tensor(profile.weight_mass, dtype=torch.float64)
    share = (w / w.sum(1, keepdim=True).clamp_min(1e-12)).numpy()
    L, E = share.shape
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * E + 2), max(3.0, 0.25 * L + 1.5)))
    im = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    for r, layer in enumerate(profile.layers):
        for e in profile.hot_experts(layer, coverage=coverage):
            ax.add_patch(Rectangle((e - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.0))
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    step = max(1, L // 16)
    ax.set_yticks(range(0, L, step), [str(profile.layers[i]) for i in range(0, L, step)])
    ax.set_title(f"{profile.model_type}: routing-weight share per layer\n{profile.tokens} {profile.token_selection} "
                 f"tokens, top-{profile.top_k}; red = hot experts to {coverage:.0%}", fontsize=8)
    fig.colorbar(im, ax=ax, label="share of layer's routing weight")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
