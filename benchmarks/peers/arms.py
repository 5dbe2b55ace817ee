"""What each arm of the peers benchmark trains: the head's shape, the data budget and each trainer's own defaults.

Two arms per peer by default: `defaults` (the peer's optimizer, schedule, TTT depth, norms and loss, as a user of that
peer gets them) and `ours` (the peer's code at specdistill's settings); a third on request, `ours-1row` (our settings
at one conversation per optimizer step, as specdistill's `trainer.micro_batch_size=1`). Every arm shares the head's
shape, the aux layers, the draft vocabulary (one d2t / t2d for all), the training rows and the loss tokens (answer
tokens only), so a difference in tau comes from the trainer.

Aux layer conventions: specdistill, vLLM and speculators name a feature by k = hidden_states[k] (the stream after k
decoder layers); SpecForge (SGLang) and ModelOpt name the decoder layer whose output it is, j = k - 1."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional

PEERS = ("speculators", "specforge", "modelopt")
ARM_KINDS = ("defaults", "ours", "ours-1row")
DEFAULT_ARM_KINDS = ("defaults", "ours")
OUTPUT_ID_PEERS = ("specforge", "modelopt")  # peers that count aux layers by decoder-layer output (ours - 1)


@dataclass(frozen=True)
class HeadShape:
    """The head every arm trains (the recipe eagle3_serve on SmolLM2-135M-Instruct)."""
    aux_layer_ids: tuple[int, ...] = (2, 15, 27)  # specdistill / vLLM convention
    draft_vocab_size: int = 8192
    num_layers: int = 1
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3


@dataclass(frozen=True)
class TrainSettings:
    """How one arm trains. Loss tokens are the same for all (the writers' answer masks); the budget is set apart."""
    ttt_steps: int
    step_decay: float  # loss weight of TTT step j is step_decay ** j
    lr: float
    optimizer: str  # adamw | muon
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = None
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | linear | cosine (decay to zero over the run after warm-up)
    rows_per_step: int = 1  # conversations per optimizer step (speculators packs tokens instead: tokens_per_step)
    tokens_per_step: Optional[int] = None
    loss: str = "kl"  # kl = forward KL to the target over the draft vocabulary (cross-entropy to its softmax)
    norms: dict = field(default_factory=dict)  # peer-specific norm switches (see converters.INEXACT)


# recipe=eagle3_serve's settings, but for the schedule: the peers at our settings keep the lr constant after warm-up,
# where the recipe decays it by cosine to 0.1x over the run (in our trainer that schedule is trainer.min_lr_ratio=1.0)
OURS = TrainSettings(ttt_steps=4, step_decay=0.8, lr=1e-3, optimizer="adamw", betas=(0.9, 0.95), max_grad_norm=0.5,
                     warmup_steps=10, schedule="constant", rows_per_step=8)

# Each peer's own defaults, read from its 0.x source (speculators train/config/schema.py, SpecForge config/schema.py +
# optimizer.py + training/strategies/base.py, ModelOpt speculative/config.py + eagle/default_config.py).
PEER_DEFAULTS: dict[str, TrainSettings] = {
    "speculators": TrainSettings(ttt_steps=3, step_decay=1.0, lr=1e-3, optimizer="muon", weight_decay=0.01,
                                 schedule="linear", tokens_per_step=8192, loss="kl_div",
                                 norms={"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}),
    "specforge": TrainSettings(ttt_steps=7, step_decay=0.8, lr=1e-4, optimizer="adamw", max_grad_norm=0.5,
                               schedule="cosine", rows_per_step=1, norms={"warmup_ratio": 0.015}),
    "modelopt": TrainSettings(ttt_steps=3, step_decay=0.9, lr=1e-4, optimizer="adamw", schedule="constant",
                              rows_per_step=1, norms={"use_input_layernorm_in_first_layer": True,
                                                      "use_last_layernorm": True}),
}

# The peer's code at our settings: our optimizer, warm-up, TTT depth and decay, and the norms of our served layout
OURS_NORMS: dict[str, dict] = {
    "speculators": {"norm_before_residual": False, "norm_before_fc": False, "norm_output": False},
    "specforge": {},
    "modelopt": {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True},
}


def settings_for(peer: str, kind: str) -> TrainSettings:
    if peer not in PEERS or kind not in ARM_KINDS:
        raise ValueError(f"arm {peer}/{kind}: peers {PEERS}, kinds {ARM_KINDS}")
    if kind == "defaults":
        return PEER_DEFAULTS[peer]
    rows = 1 if kind == "ours-1row" else OURS.rows_per_step
    return replace(OURS, rows_per_step=rows, norms=dict(OURS_NORMS[peer]))


def peer_aux_ids(peer: str, ours: tuple[int, ...]) -> list[int]:
    """Our aux ids in the peer's own convention (SpecForge and ModelOpt count decoder-layer outputs: ours - 1)."""
    return [k - 1 for k in ours] if peer in OUTPUT_ID_PEERS else list(ours)


def our_aux_ids(peer: str, theirs: list[int]) -> list[int]:
    """The inverse of peer_aux_ids."""
    return [j + 1 for j in theirs] if peer in OUTPUT_ID_PEERS else list(theirs)


def arm_record(peer: str, kind: str, shape: HeadShape) -> dict:
    """What an arm was trained with, for results.json."""
    return {"peer": peer, "arm": kind, "shape": asdict(shape), "settings": asdict(settings_for(peer, kind)),
            "peer_aux_ids": peer_aux_ids(peer, shape.aux_layer_ids)}
