"""specdistill's regenerated store (data/regenerated.py) written in each peer trainer's own training-data format.

No answer is decoded again and the target runs no forward: the store's ids, aux features and post-norm final states
are copied as they are. speculators' loss reads the target's PRE-norm final layer, and uses it only through the
target's final RMSNorm (its verifier_norm) before lm_head, so it gets final / w (w the norm's weight): a state whose
RMSNorm is the store's post-norm state up to a factor 1 / sqrt(1 + eps / mean(h^2)), about 1 - 1e-5 here.
Fields, from each peer's reader (0.x releases):
  speculators  datasets.save_to_disk folder with columns input_ids, loss_mask, seq_len (train/data.py ArrowDataset)
               + hidden_states/hs_<i>.safetensors {token_ids (T,) int64, hidden_states (T, 4, H): the 3 aux layers
               then the pre-norm final layer} (hs_connectors FileTransfer) + d2t-<Vd>.npy / t2d-<Vd>.npy
  specforge    one torch.save .ckpt per row {input_ids (T,), loss_mask (T,), hidden_state (1, T, H) post-norm final,
               aux_hidden_state (1, T, 3H)} (runtime/data_plane/offline_reader.py, algorithms/eagle3/data.py)
  modelopt     one torch.save .pt per row {input_ids (T,), hidden_states (T, H) post-norm final, aux_hidden_states
               (T, 3H), loss_mask (T,)} (speculative/eagle/utils.py OfflineSupervisedDataset) + d2t.pt
Loss masks are the answer tokens in every format. Each peer indexes its mask by a different position, so the mask
is written with the offset that makes the peer score exactly the predictions of answer tokens:
  speculators, modelopt  mask[p] gates the target distribution at position p, which predicts token p + 1: offset 1
                         (specdistill's own convention, data/regenerated.loss_mask_for)
  specforge              mask[t] gates the head's slot t, which reads token t + 1 and predicts token t + 2: offset 2
The rows are the ones specdistill's trainer trains on: the store minus the same held-out tail (heldout_rows).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

MASK_OFFSET = {"speculators": 1, "modelopt": 1, "specforge": 2}


def answer_mask(length: int, prompt_length: int, offset: int) -> torch.Tensor:
    """(T,) long: mask[p] = 1 iff token p + offset exists and is an answer token (index >= prompt_length)."""
    p = torch.arange(length) + offset
    return ((p >= prompt_length) & (p < length)).long()


def heldout_rows(num_rows: int, heldout_size: int) -> int:
    """How many rows at the end of the store specdistill's trainer holds out (pipeline/regenerate.py)."""
    return min(heldout_size, max(1, num_rows // 10)) if heldout_size > 0 else 0


@dataclass
class StoreRow:
    ids: torch.Tensor  # (T,) int64
    aux: torch.Tensor  # (T, 3H) bf16
    final: torch.Tensor  # (T, H) bf16, post-norm (what lm_head reads)
    prompt_length: int
    part: int


def read_rows(root, parts: Optional[int] = None) -> list[StoreRow]:
    """Every row of a store, in order, part by part (parts: how many to read; all on disk when None)."""
    from safetensors.torch import load_file

    root = Path(root)
    files = sorted(root.glob("part-*.safetensors"))
    if parts is not None:
        files = files[:parts]
    rows = []
    for f in files:
        t = load_file(str(f))
        k = int(f.stem.split("-")[1])
        lengths = t["lengths"].tolist()
        for ids, aux, final, p in zip(torch.split(t["ids"], lengths), torch.split(t["aux"], lengths),
                                      torch.split(t["final"], lengths), t["prompt_lengths"].tolist()):
            rows.append(StoreRow(ids, aux, final, int(p), k))
    if not rows:
        raise FileNotFoundError(f"{root} has no part-*.safetensors: run the regeneration first (train.py "
                                "recipe=eagle3_serve writes the store)")
    return rows


def split_rows(rows: list[StoreRow], heldout_size: int) -> tuple[list[StoreRow], list[StoreRow]]:
    n = heldout_rows(len(rows), heldout_size)
    return rows[: len(rows) - n], rows[len(rows) - n:]


def answer_tokens(rows: list[StoreRow]) -> int:
    return sum(len(r.ids) - r.prompt_length for r in rows)


# ------------------------------------------------------------------------------------------------------ speculators
def final_norm(target_model) -> torch.nn.Module:
    """The target's final norm (what turns the last decoder layer's output into what lm_head reads)."""
    inner = getattr(target_model, "model", target_model)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise ValueError(f"{type(target_model).__name__} has no model.norm: cannot recover the pre-norm final layer")
    return norm


def final_norm_weight(target_model) -> torch.Tensor:
    """The target's final RMSNorm weight (H,) fp32."""
    norm = final_norm(target_model)
    if getattr(norm, "weight", None) is None:
        raise ValueError(f"{type(norm).__name__} has no weight: cannot recover the pre-norm final layer from the "
                         "store's post-norm states")
    return norm.weight.detach().float().cpu()


def prenorm_from_postnorm(final: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T, H) fp32: final / weight, whose RMSNorm with this weight is `final` again (the per-token scale the norm
    removed is not recoverable and does not matter: RMSNorm is invariant to it). final / weight is h / rms(h), whose
    mean square is 1; where the weight is 0 that component is lost, and is filled so that the mean square stays 1
    (RMSNorm's output there is 0, as in the store)."""
    w = weight.float()
    live = w.abs() > 1e-12
    x = torch.where(live, final.float() / torch.where(live, w, torch.ones_like(w)), torch.zeros_like(w))
    dead = int((~live).sum())
    if dead:
        rest = (x.shape[-1] - x.square().sum(-1, keepdim=True)).clamp_min(0) / dead  # (T, 1)
        x = torch.where(live, x, rest.sqrt().expand_as(x))
    return x


def check_prenorm(target_model, pre: torch.Tensor, final: torch.Tensor, row: int) -> None:
    """The recovered pre-norm states must give the store's post-norm ones through the target's norm (bf16 tolerance):
    a store whose states do not come from this target's final norm (another target's norm weights) is refused here
    rather than trained on."""
    with torch.no_grad():
        norm = final_norm(target_model)
        got = norm(pre.to(next(norm.parameters()).dtype)).float()
    valid = final.float().abs().sum(-1) > 0  # a row's last slot holds zeros in the store (never fed)
    err = (got[valid] - final.float()[valid]).abs().max().item() if bool(valid.any()) else 0.0
    scale = final.float().abs().max().item() + 1e-6
    if err > 2e-2 * scale:
        raise ValueError(f"row {row}: the target's final norm of the recovered pre-norm states differs from the "
                         f"store's post-norm states by {err:.3g} (scale {scale:.3g}): the store was made with another "
                         "target or settings")


def write_vocab_npy(out: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> tuple[Path, Path]:
    import numpy as np

    vd = d2t.numel()
    p_d2t, p_t2d = out / f"d2t-{vd}.npy", out / f"t2d-{vd}.npy"
    np.save(p_d2t, d2t.long().numpy())
    np.save(p_t2d, t2d.bool().numpy())
    return p_d2t, p_t2d


def write_speculators(rows: list[StoreRow], held: list[StoreRow], out, target_model, d2t: torch.Tensor,
                      t2d: torch.Tensor, log: Callable[[str], None] = print) -> dict:
    """speculators' offline data folder: train rows then held-out rows (its validation split); returns the
    train_data_ratio that splits exactly there and the paths. target_model gives only its final norm (no forward)."""
    import datasets
    from safetensors.torch import save_file

    out = Path(out)
    every = rows + held
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    weight = final_norm_weight(target_model)
    masks = []
    for i, r in enumerate(every):
        pre = prenorm_from_postnorm(r.final, weight)  # the pre-norm final layer, up to a per-token scale
        check_prenorm(target_model, pre, r.final, i)
        H = r.final.shape[-1]
        aux = r.aux.view(len(r.ids), -1, H)  # (T, 3, H)
        hs = torch.cat([aux.float(), pre[:, None]], dim=1).to(torch.bfloat16).contiguous()  # (T, 4, H)
        save_file({"token_ids": r.ids.long().contiguous(), "hidden_states": hs}, str(hs_dir / f"hs_{i}.safetensors"))
        masks.append(answer_mask(len(r.ids), r.prompt_length, MASK_OFFSET["speculators"]))
    ds = datasets.Dataset.from_dict({"input_ids": [r.ids.tolist() for r in every],
                                     "loss_mask": [m.tolist() for m in masks],
                                     "seq_len": [len(r.ids) for r in every]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    p_d2t, p_t2d = write_vocab_npy(out, d2t, t2d)
    ratio = (len(rows) + 0.5) / len(every)  # int(len(every) * ratio) == len(rows): the split falls at the held rows
    meta = {"format": "speculators", "rows": len(rows), "held": len(held), "train_data_ratio": ratio,
            "d2t_path": str(p_d2t), "t2d_path": str(p_t2d), "loss_tokens": answer_tokens(rows)}
    (out / "specdistill_peer_data.json").write_text(json.dumps(meta, indent=1))
    log(f"[peers/data] speculators: {len(every)} rows ({len(rows)} train) -> {out}")
    return meta


# ------------------------------------------------------------------------------------------------------- specforge
def write_specforge(rows: list[StoreRow], out, d2t: torch.Tensor, t2d: torch.Tensor,
                    log: Callable[[str], None] = print) -> dict:
    """SpecForge's offline EAGLE-3 feature files (one .ckpt per row) and the vocabulary maps beside them."""
    out = Path(out)
    data = out / "features"
    data.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(rows):
        torch.save({"input_ids": r.ids.long().clone(),
                    "loss_mask": answer_mask(len(r.ids), r.prompt_length, MASK_OFFSET["specforge"]),
                    "hidden_state": r.final.clone()[None],  # (1, T, H): post-norm, what lm_head reads
                    "aux_hidden_state": r.aux.clone()[None]}, data / f"row-{i:06d}.ckpt")  # (1, T, 3H)
    torch.save({"d2t": d2t.long().clone(), "t2d": t2d.bool().clone()}, out / "vocab_map.pt")
    meta = {"format": "specforge", "rows": len(rows), "features": str(data), "vocab_map": str(out / "vocab_map.pt"),
            "loss_tokens": answer_tokens(rows)}
    (out / "specdistill_peer_data.json").write_text(json.dumps(meta, indent=1))
    log(f"[peers/data] specforge: {len(rows)} rows -> {data}")
    return meta


# -------------------------------------------------------------------------------------------------------- modelopt
def write_modelopt(rows: list[StoreRow], out, d2t: torch.Tensor, log: Callable[[str], None] = print) -> dict:
    """ModelOpt's offline EAGLE dump (one .pt per row, post-norm final states) and its draft-vocabulary cache."""
    out = Path(out)
    data = out / "dump"
    data.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(rows):
        torch.save({"input_ids": r.ids.long().clone(), "hidden_states": r.final.clone(),
                    "aux_hidden_states": r.aux.clone(),
                    "loss_mask": answer_mask(len(r.ids), r.prompt_length, MASK_OFFSET["modelopt"])},
                   data / f"row-{i:06d}.pt")
    torch.save(d2t.long().clone(), out / "d2t.pt")
    meta = {"format": "modelopt", "rows": len(rows), "dump": str(data), "d2t_path": str(out / "d2t.pt"),
            "loss_tokens": answer_tokens(rows)}
    (out / "specdistill_peer_data.json").write_text(json.dumps(meta, indent=1))
    log(f"[peers/data] modelopt: {len(rows)} rows -> {data}")
    return meta
