"""Dense -> MoE conversion whose experts specialise (MoEfication, Zhang et al. 2022, arXiv 2110.01786).

For each layer of a dense Llama-family model, on real calibration tokens:
1. record the MLP input x and the neuron activations h = act(gate x) * up x;
2. cluster the I intermediate neurons into E groups of I/E by co-activation: balanced spherical k-means on each
   neuron's standardised contribution pattern over the tokens (|h_i| * ||down[:, i]||). Neurons whose contributions
   rise and fall together share an expert, so for a given token a few experts carry most of the MLP's output.
   Balanced, because an HF MoE config has one expert size; k-means rather than MoEfication's graph partitioning
   (METIS is not installable here) and with a greedy capacity-constrained assignment rather than an exact
   min-cost assignment (cubic in I, no scipy here): the greedy step is the usual balanced k-means heuristic;
3. each group becomes an expert holding its slice of gate/up/down;
4. a router (a linear layer on the MLP input, moe/router_fit.py) is fitted to rank each token's groups by the
   norm of their true output; the MoE picks its top-k.

The output is a standard transformers MixtralForCausalLM: experts of intermediate_size I/E, num_experts_per_tok
k, no shared expert (Qwen2-MoE always adds one; Qwen3-MoE and OLMoE could also hold this, Mixtral is the plainest).

Routing weights. The dense MLP sums all groups unweighted: down h = sum_g down_g h_g. A Mixtral block computes
sum_{e in top-k} w_e f_e(x) with w the softmax renormalised over the top-k (sum w = 1). Each expert's down_proj is
therefore stored times k, and the router is scaled so its logits differ by only `router_spread` (a positive scale
keeps every token's top-k): then k * w_e = 1 + O(spread) and the MoE computes the unweighted sum of the selected
groups, MoEfication's approximation of the dense MLP. With k = E (every expert active) the router is written as
zeros: w_e = 1/E exactly and the conversion reproduces the dense model (up to float summation order).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.moe.router_fit import fit_router, group_output_norms, scale_to_spread, topk_recall
from specdistill.moe.routing import decoder_layers
from specdistill.moe.upcycle import NON_MLP_LAYER_WEIGHTS, load_moe_state, mixtral_config, non_mlp_state

DENSE_MLP_WEIGHTS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass
class MoefyConfig:
    num_experts: int = 8  # E: experts per layer, each I/E neurons
    top_k: int = 2  # k: experts active per token
    tokens: int = 16384  # calibration tokens (non-padding) the clustering and the router fit see
    kmeans_iters: int = 25
    router_spread: float = 0.05  # mean per-token std of router logits: how far k * w_e may stray from 1
    ridge: float = 1e-3  # router fit regularisation, relative to the mean eigenvalue of x^T x
    seed: int = 0

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"--experts {self.num_experts}: need at least 1 expert per layer")
        if self.top_k < 1:
            raise ValueError(f"--top-k {self.top_k}: every token needs at least 1 active expert")
        if self.top_k > self.num_experts:
            raise ValueError(f"--top-k {self.top_k} > --experts {self.num_experts}: a token cannot use more experts "
                             f"than a layer has; choose top-k in [1, {self.num_experts}]")
        if self.tokens < self.num_experts:
            raise ValueError(f"--tokens {self.tokens}: need at least one calibration token per expert "
                             f"({self.num_experts}); thousands give stable clusters")
        if not self.router_spread > 0:
            raise ValueError(f"router_spread={self.router_spread} must be > 0 (it scales the router's logits)")
        if self.kmeans_iters < 1 or self.ridge < 0:
            raise ValueError(f"kmeans_iters={self.kmeans_iters} must be >= 1 and ridge={self.ridge} >= 0")

    def check_intermediate(self, intermediate_size: int) -> None:
        if intermediate_size % self.num_experts:
            divisors = [d for d in range(1, min(intermediate_size, 64) + 1) if intermediate_size % d == 0]
            raise ValueError(f"--experts {self.num_experts} does not divide the MLP's intermediate size "
                             f"{intermediate_size}: experts must be equal slices; choose one of {divisors}")


def check_dense_llama(model) -> None:
    """The converter copies attention and norms as they are and splits a bias-free SwiGLU MLP: refuse anything else
    (a bias or an extra weight would be silently dropped), naming the weight."""
    known = set(NON_MLP_LAYER_WEIGHTS) | set(DENSE_MLP_WEIGHTS)
    for key in model.state_dict():
        if ".layers." in key:
            name = key.split(".layers.", 1)[1].split(".", 1)[1]
            if name not in known:
                raise ValueError(f"{type(model).__name__} has layer weight {key!r}, which a Mixtral layer cannot hold: "
                                 "the converter takes a dense Llama-family model (bias-free attention, SwiGLU MLP "
                                 "gate/up/down_proj), e.g. Llama, SmolLM2, Mistral")
    if not hasattr(model.config, "intermediate_size"):
        raise ValueError(f"{type(model).__name__}'s config has no intermediate_size: not a dense Llama-family model")


# ---------------------------------------------------------------- calibration
@torch.no_grad()
def capture_mlp_inputs(model, batches: Iterable[dict], max_tokens: int, progress=None) -> list[torch.Tensor]:
    """Every layer's MLP input on the non-padding tokens of `batches`, in order, until `max_tokens`:
    one (N, H) float32 tensor per layer (N <= max_tokens). `progress(n)` is told how many tokens each batch added."""
    layers = decoder_layers(model)
    store: list[list[torch.Tensor]] = [[] for _ in layers]
    mask: dict = {}

    def hook(i):
        def pre(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])  # (B*T, H)
            store[i].append(x[mask["m"]].float().cpu())
        return pre

    handles = [layer.mlp.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    device = next(model.parameters()).device
    seen = 0
    try:
        for batch in batches:
            mask["m"] = batch["attention_mask"].reshape(-1).bool().to(device)
            model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                  use_cache=False, logits_to_keep=1)
            n = int(mask["m"].sum())
            seen += n
            if progress is not None:
                progress(n)
            if seen >= max_tokens:
                break
    finally:
        for h in handles:
            h.remove()
    if seen == 0:
        raise ValueError("the calibration batches hold no tokens: give the converter data")
    return [torch.cat(xs)[:max_tokens] for xs in store]


def neuron_activations(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP's intermediate activations act(gate x) * up x: x (N, H) -> (N, I)."""
    return mlp.act_fn(F.linear(x, mlp.gate_proj.weight.float())) * F.linear(x, mlp.up_proj.weight.float())


# ---------------------------------------------------------------- clustering
def coactivation_patterns(h: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Each neuron's contribution pattern over the tokens, standardised: |h_i| * ||down[:, i]||, centred and unit
    norm per neuron, so a dot product of two rows is the correlation of their contributions.
    h: (N, I), down: (H, I) -> (I, N). A dead neuron (constant contribution) gets a zero row."""
    c = (h.abs() * down.float().norm(dim=0)).T  # (I, N)
    c = c - c.mean(dim=1, keepdim=True)
    return c / c.norm(dim=1, keepdim=True).clamp_min(1e-12)


def balanced_assign(sim: torch.Tensor, size: int) -> torch.Tensor:
    """Assign n points to k clusters of exactly `size` (n = k * size), greedily by descending similarity.
    sim: (n, k) -> (n,) cluster ids. Ties resolve by index (argsort is stable), so the result is deterministic."""
    n, k = sim.shape
    if n != k * size:
        raise ValueError(f"{n} points cannot fill {k} clusters of {size}")
    order = torch.argsort(sim.reshape(-1), descending=True, stable=True).tolist()
    cluster = [-1] * n
    room = [size] * k
    left = n
    for flat in order:
        i, c = divmod(flat, k)
        if cluster[i] < 0 and room[c] > 0:
            cluster[i] = c
            room[c] -= 1
            left -= 1
            if left == 0:
                break
    return torch.tensor(cluster, dtype=torch.long)


def balanced_kmeans(points: torch.Tensor, k: int, iters: int = 25, seed: int = 0) -> torch.Tensor:
    """Spherical k-means with equal cluster sizes: points (n, d), unit rows -> groups (k, n / k) of point ids,
    each group's ids ascending. Centroids start at k distinct points drawn with `seed`."""
    n = points.shape[0]
    size = n // k
    g = torch.Generator().manual_seed(seed)
    centroids = points[torch.randperm(n, generator=g)[:k]]  # (k, d)
    assign = None
    for _ in range(iters):
        new = balanced_assign(points @ centroids.T, size)  # (n,)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        centroids = torch.stack([points[assign == c].mean(dim=0) for c in range(k)])
        centroids = centroids / centroids.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.stack([torch.nonzero(assign == c).flatten() for c in range(k)])  # ascending ids


# ---------------------------------------------------------------- one layer
@dataclass
class LayerFit:
    layer: int
    groups: torch.Tensor  # (E, I / E) neuron ids of each expert, ascending
    router: torch.Tensor  # (E, H) the router weight, already scaled (zeros when k == E)
    router_recall: float  # on the calibration tokens: share of the router's top-k among the k largest groups
    chance_recall: float  # k / E: what a random router scores
    rel_error: float  # ||unweighted sum of the router's top-k groups - dense MLP|| / ||dense MLP||
    oracle_rel_error: float  # the same with each token's k largest groups (an upper bound for any router)

    def stats(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()
                if k not in ("groups", "router")}


def selected_sum_errors(h: torch.Tensor, down: torch.Tensor, groups: torch.Tensor,
                        picks: list[torch.Tensor]) -> list[float]:
    """Relative error of summing only the picked groups' outputs, for several pickings in one pass over the groups.
    h (N, I), down (H, I), groups (E, G), each pick (N, E) bool -> one error per pick."""
    dense = torch.zeros(h.shape[0], down.shape[0])  # (N, H), the sum of all groups
    parts = [torch.zeros_like(dense) for _ in picks]
    for e, g in enumerate(groups):
        y = h[:, g] @ down[:, g].T  # (N, H) group e's output
        dense += y
        for part, pick in zip(parts, picks):
            part += pick[:, e, None] * y
    scale = dense.norm().clamp_min(1e-12)
    return [float((part - dense).norm() / scale) for part in parts]


def convert_layer(mlp: nn.Module, x: torch.Tensor, cfg: MoefyConfig, layer: int = 0) -> LayerFit:
    """Groups and router of one dense MLP from its calibration inputs x (N, H)."""
    E, k = cfg.num_experts, cfg.top_k
    with torch.no_grad():
        h = neuron_activations(mlp, x)  # (N, I)
        down = mlp.down_proj.weight.float()  # (H, I)
        groups = balanced_kmeans(coactivation_patterns(h, down), E, cfg.kmeans_iters, cfg.seed + layer)
        norms = group_output_norms(h, down, groups)  # (N, E)
        if k == E:  # every expert always active: a zero router gives w_e = 1/E exactly (see the module docstring)
            router = torch.zeros(E, x.shape[1])
        else:
            router = scale_to_spread(fit_router(x, norms, cfg.ridge), x, cfg.router_spread)
        scores = x @ router.T  # (N, E)
        picked = torch.zeros_like(norms, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
        best = torch.zeros_like(norms, dtype=torch.bool).scatter_(1, norms.topk(k, dim=1).indices, True)
        err, oracle_err = selected_sum_errors(h, down, groups, [picked, best])
        return LayerFit(layer=layer, groups=groups, router=router,
                        router_recall=topk_recall(scores, norms, k) if k < E else 1.0, chance_recall=k / E,
                        rel_error=err, oracle_rel_error=oracle_err)


# ---------------------------------------------------------------- the model
def assemble_mixtral(dense, fits: list[LayerFit], cfg: MoefyConfig):
    """A MixtralForCausalLM holding `dense`'s attention, norms, embeddings and head, and per layer the experts and
    router of `fits`. Expert down_proj is stored times k (Mixtral's top-k weights sum to 1; see the docstring)."""
    from transformers import MixtralForCausalLM

    d = dense.config
    E, k = cfg.num_experts, cfg.top_k
    moe_cfg = mixtral_config(d, E, k, d.intermediate_size // E)
    moe_cfg.specdistill_moefied = {
        "source": getattr(d, "_name_or_path", ""), **asdict(cfg),
        "method": "co-activation balanced k-means + ridge router (specdistill/moe/convert.py)"}
    moe = MixtralForCausalLM(moe_cfg).to(dense.dtype)
    dsd = dense.state_dict()
    sd = non_mlp_state(dsd, d.num_hidden_layers)
    for fit in fits:
        p = f"model.layers.{fit.layer}."
        gate, up, down = (dsd[p + name] for name in DENSE_MLP_WEIGHTS)  # (I, H), (I, H), (H, I)
        # (E, 2G, H)
        sd[p + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([gate[g], up[g]]) for g in fit.groups])
        sd[p + "mlp.experts.down_proj"] = torch.stack([down[:, g] * k for g in fit.groups])  # (E, H, G)
        sd[p + "mlp.gate.weight"] = fit.router.to(dense.dtype)  # (E, H)
    return load_moe_state(moe, sd, "dense -> MoE conversion")


@dataclass
class Moefied:
    model: nn.Module  # MixtralForCausalLM
    layers: list[LayerFit]
    settings: MoefyConfig
    tokens: int  # calibration tokens used

    def summary(self) -> dict:
        recall = [f.router_recall for f in self.layers]
        return {"settings": asdict(self.settings), "calibration_tokens": self.tokens,
                "mean_router_recall": round(sum(recall) / len(recall), 4),
                "chance_recall": round(self.settings.top_k / self.settings.num_experts, 4),
                "layers": [f.stats() for f in self.layers],
                "groups": [f.groups.tolist() for f in self.layers]}


def moefy(dense, batches: Iterable[dict], cfg: MoefyConfig, tqdm_factory=None) -> Moefied:
    """Convert `dense` (a Llama-family causal LM) on calibration `batches` (collated: input_ids, attention_mask).
    `tqdm_factory(total=, desc=, unit=)`, if given, makes the progress bars (calibration tokens, layers)."""
    check_dense_llama(dense)
    cfg.check_intermediate(dense.config.intermediate_size)
    dense.eval()
    bar = tqdm_factory(total=cfg.tokens, desc="calibration forward", unit="tok") if tqdm_factory else None
    xs = capture_mlp_inputs(dense, batches, cfg.tokens, bar.update if bar else None)
    if bar:
        bar.close()
    layers = decoder_layers(dense)
    fits = []
    bar = tqdm_factory(total=len(layers), desc="cluster + fit router", unit="layer") if tqdm_factory else None
    for i, layer in enumerate(layers):
        fits.append(convert_layer(layer.mlp, xs[i], cfg, i))
        if bar:
            bar.update(1)
            bar.set_postfix(recall=f"{fits[-1].router_recall:.2f}", chance=f"{cfg.top_k / cfg.num_experts:.2f}")
    if bar:
        bar.close()
    return Moefied(assemble_mixtral(dense, fits, cfg), fits, cfg, int(xs[0].shape[0]))

