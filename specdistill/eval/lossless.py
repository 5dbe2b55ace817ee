"""Whether two greedy decoding paths of one target agree as a lossless decoder must: token identity in fp32, and in
bf16 every divergence explained by rounding, as an fp32 copy of the target and the paths' measured noise decide.

Two decodings of one target (a growing and a static KV cache, eager and compiled kernels, target-only steps and
speculative verification) compute the same logits in different summation orders. In fp32 with TF32 off those orders
agree to about 1e-6 and the greedy tokens must be identical: any difference fails. In bf16 they differ by rounding,
and where the target's two best logits are closer than that rounding either token may come out. Per divergence (the
first differing token of a row) the verdict reads:
  fp32_margin  top-1 minus top-2 of the fp32 copy's logits after the prompt and the common prefix: how far the exact
               computation is from a tie there;
  noise        how far each bf16 path's logits lie from the fp32 copy's, measured with the reference tokens fed to
               each path (teacher-forced): per position the max over the vocabulary, then the max over positions.
A bf16 path emits a token other than the fp32 argmax only where the fp32 margin is within twice its deviation (the
two logits each move by at most the deviation, toward each other), and at a divergence at least one of the two paths
left the fp32 argmax. So a divergence whose fp32 margin is within 2 x the larger path deviation is rounding, and one
beyond it fails. A path whose deviation is far beyond a plain bf16 forward's (NOISE_GUARD) is wrong in itself: its
noise would excuse any divergence, so the verdict fails it.

This module knows nothing about which paths are compared or why; judge() is pure, the rest runs the models.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

import torch

from specdistill.decoding import CacheMode
from specdistill.decoding.kv import device_of

# A bf16 path may deviate from the fp32 copy by at most this many times a plain bf16 forward's largest deviation
# (one forward over the whole sequence, no cache) before its noise counts as a fault rather than rounding.
NOISE_GUARD = 4.0


@dataclass(frozen=True)
class Divergence:
    """The first new token where one row's two decodings differ."""
    row: int
    position: int                     # index into the new tokens (0 = the first)
    reference_token: Optional[int]    # None: the reference ended before this position
    other_token: Optional[int]        # None: the other decoding ended before this position
    fp32_margin: Optional[float] = None  # top-1 minus top-2 of the fp32 logits after the prompt and common prefix


@dataclass(frozen=True)
class Spread:
    """Per-position deviations (each the max over the vocabulary of |a - b|): their count, median, p99 and max."""
    positions: int
    median: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: torch.Tensor) -> "Spread":
        v = values.detach().flatten().double().cpu()
        if v.numel() == 0:
            raise ValueError("Spread.of needs at least one position")
        return cls(v.numel(), v.median().item(), torch.quantile(v, 0.99).item(), v.max().item())


@dataclass(frozen=True)
class Noise:
    """Measured bf16 rounding of two paths at the same teacher-forced positions."""
    reference_vs_fp32: Spread  # the reference path's logits against the fp32 copy's
    other_vs_fp32: Spread      # the other path's logits against the fp32 copy's
    between_paths: Spread      # the two bf16 paths against each other
    plain_vs_fp32: Spread      # one plain bf16 forward over the whole sequence (no cache) against the fp32 copy
    argmax_flips: int          # teacher-forced positions where the two paths' argmax differ

    @property
    def deviation(self) -> float:
        """The larger path's largest per-logit deviation from the fp32 copy."""
        return max(self.reference_vs_fp32.max, self.other_vs_fp32.max)

    @property
    def bound(self) -> float:
        """An fp32 margin at most this large can be flipped by rounding (module docstring)."""
        return 2.0 * self.deviation

    @property
    def plausible(self) -> bool:
        """The paths deviate from fp32 as bf16 rounding does: within NOISE_GUARD x a plain bf16 forward's deviation."""
        return self.deviation <= NOISE_GUARD * self.plain_vs_fp32.max

    def to_dict(self) -> dict:
        return {**{k: asdict(v) for k, v in vars(self).items() if isinstance(v, Spread)},
                "argmax_flips": self.argmax_flips, "deviation": self.deviation, "bound": self.bound,
                "guard": NOISE_GUARD, "plausible": self.plausible}


@dataclass(frozen=True)
class Judged:
    divergence: Divergence
    rounding: bool            # the fp32 margin is within the noise bound (bf16 only; fp32 divergences never are)
    noise_bound: Optional[float]


@dataclass
class Verdict:
    """Two decodings of the same rows compared: each divergence judged, and what fails."""
    precision: str                 # "fp32" (TF32 off: token identity required) or "bf16"
    rows: int
    judged: list[Judged] = field(default_factory=list)
    noise: Optional[Noise] = None  # bf16 only
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "precision": self.precision, "rows": self.rows,
                "identical_rows": self.rows - len(self.judged),
                "rounding": sum(j.rounding for j in self.judged),
                "beyond_noise": sum(not j.rounding for j in self.judged),
                "noise": None if self.noise is None else self.noise.to_dict(),
                "divergences": [{**asdict(j.divergence), "noise_bound": j.noise_bound, "rounding": j.rounding}
                                for j in self.judged],
                "problems": self.problems}


# ------------------------------------------------------------------------------------------------ the verdict (pure)
def first_divergences(reference: list[list[int]], other: list[list[int]]) -> list[Divergence]:
    """Per row whose token lists differ, where they first differ (the shorter's length when one extends the other)."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference rows against {len(other)} other rows: compare the same rows")
    out = []
    for row, (a, b) in enumerate(zip(reference, other)):
        if a == b:
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append(Divergence(row, j, a[j] if j < len(a) else None, b[j] if j < len(b) else None))
    return out


def judge(rows: int, divergences: list[Divergence], *, exact: bool, noise: Optional[Noise] = None) -> Verdict:
    """exact (fp32, TF32 off): every divergence fails. Else (bf16) a divergence is rounding when its fp32 margin is
    within noise.bound; one beyond it, one without a margin (a decoding that stopped where the other went on), and
    noise beyond bf16 rounding (Noise.plausible) fail."""
    if exact:
        v = Verdict("fp32", rows, [Judged(d, False, None) for d in divergences])
        v.problems = [f"row {d.row} token {d.position}: {d.reference_token} vs {d.other_token} (fp32 margin "
                      f"{_num(d.fp32_margin)}); fp32 decodings with TF32 off must be token-identical"
                      for d in divergences]
        return v
    if noise is None:
        raise ValueError("a bf16 verdict needs the paths' measured noise (measure_noise); pass exact=True for fp32")
    v = Verdict("bf16", rows, noise=noise)
    if not noise.plausible:
        v.problems.append(f"a bf16 path deviates from the fp32 copy by up to {noise.deviation:.4g} per logit, beyond "
                          f"{NOISE_GUARD:g} x a plain bf16 forward's {noise.plain_vs_fp32.max:.4g}: that path computes "
                          "other logits, not rounded ones")
    for d in divergences:
        rounding = d.fp32_margin is not None and d.fp32_margin <= noise.bound
        v.judged.append(Judged(d, rounding, noise.bound))
        if d.fp32_margin is None:
            v.problems.append(f"row {d.row} token {d.position}: one decoding ended where the other went on "
                              f"({d.reference_token} vs {d.other_token})")
        elif not rounding:
            v.problems.append(f"row {d.row} token {d.position}: {d.reference_token} vs {d.other_token} where the fp32 "
                              f"margin {d.fp32_margin:.4g} exceeds the noise bound {noise.bound:.4g}")
    return v


def _num(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.4g}"


# ------------------------------------------------------------------------------------------------ measurements
@contextmanager
def tf32_off() -> Iterator[None]:
    """fp32 matmuls and convolutions in full fp32 inside (CUDA would otherwise round their inputs to TF32's 10-bit
    mantissa, about bf16's precision); the settings before are restored after. Loading a model through
    models.target.load_causal_lm turns TF32 on, so enter this after loading."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


def tf32_state() -> dict:
    """The TF32 switches now (matmul, cudnn): both False is what an exact fp32 comparison needs."""
    return {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}


@dataclass(frozen=True)
class DecodePath:
    """How one decoding feeds the target: its KV cache, and tokens per forward (1: a target-only step; gamma + 1: a
    speculative verify). hidden_states: the forwards return hidden states (feature capture), as that decode's do."""
    name: str
    cache: CacheMode = CacheMode()
    chunk: int = 1
    hidden_states: bool = False


def teacher_forced_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokens: torch.Tensor,
                          path: DecodePath) -> torch.Tensor:
    """(B, M, V) logits `path` computes for new tokens 0..M-1 when fed `tokens` (B, N) in place of its own choices:
    the left-padded prompt (B, T) but its last token prefilled, then [last prompt token, tokens[:, :M-1]] path.chunk
    at a time through the decoders' KV cache (kv.BatchKV). M is N rounded down to whole chunks, so a compiled path
    meets only the shapes it decodes with."""
    if path.chunk < 1:
        raise ValueError(f"DecodePath {path.name!r}: chunk must be >= 1, got {path.chunk}")
    B, N = tokens.shape
    M = N - N % path.chunk
    if M == 0:
        raise ValueError(f"{N} tokens make no whole chunk of {path.chunk}: pass at least {path.chunk} tokens")
    device = input_ids.device
    kwargs = {"output_hidden_states": True} if path.hidden_states else {}
    with torch.no_grad():
        kv = path.cache.factory(input_ids.shape[1] - 1 + M + path.chunk)(model)
        kv.prefill(input_ids[:, :-1], attention_mask[:, :-1], **kwargs)
        fed = torch.cat([input_ids[:, -1:], tokens[:, : M - 1].to(device)], dim=1)   # (B, M)
        out = []
        for s in range(0, M, path.chunk):
            out.append(kv.step(fed[:, s: s + path.chunk], **kwargs).logits)         # (B, chunk, V)
            kv.commit_all()
    return torch.cat(out, dim=1)                                                     # (B, M, V)


def plain_logits(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(M, V) float32 logits of one forward without a cache over prompt (P,) real tokens and tokens (M,): those at the
    positions that predict tokens 0..M-1."""
    ids = torch.cat([prompt, tokens[:-1].to(prompt.device)])[None]                  # (1, P + M - 1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.numel() - 1:]                 # (M, V)
    return logits.float()


def fp32_margins(model32, input_ids: torch.Tensor, attention_mask: torch.Tensor, reference: list[list[int]],
                 divergences: list[Divergence]) -> list[Divergence]:
    """Each divergence with its fp32 margin: top-1 minus top-2 of model32's logits after the row's real prompt tokens
    and the reference's tokens before the divergence (one forward per divergence; model32 is the fp32 copy, run with
    TF32 off)."""
    out = []
    for d in divergences:
        prompt = input_ids[d.row][attention_mask[d.row].bool()]
        ids = torch.cat([prompt, torch.tensor(reference[d.row][: d.position], dtype=prompt.dtype,
                                              device=prompt.device)])[None]          # (1, P + position)
        with torch.no_grad(), tf32_off():
            top2 = model32(input_ids=ids.to(device_of(model32))).logits[0, -1].float().topk(2).values
        out.append(Divergence(d.row, d.position, d.reference_token, d.other_token, (top2[0] - top2[1]).item()))
    return out


def deviation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., V), (..., V) -> (...,): the max over the vocabulary of |a - b|, in float32."""
    return (a.float() - b.float()).abs().amax(-1)


def measure_noise(model, model32, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokens: torch.Tensor,
                  reference: DecodePath, other: DecodePath, rows_per_call: Optional[int] = None) -> Noise:
    """Both paths of the bf16 `model` teacher-forced on tokens (B, N) (the reference decoding's), each against
    model32's fp32 logits (TF32 off) at the same positions, and against each other; a plain bf16 forward too (the
    guard). The bf16 paths run in the caller's settings, as their decodings ran (a compiled graph guards on them).
    rows_per_call: rows fed per teacher-forced call (default all B; 1 feeds each row without its padding, as a
    decoding at batch 1 ran: a compiled path then reuses that decoding's graphs)."""
    B = tokens.shape[0]
    k = B if rows_per_call is None else rows_per_call
    dev = {"reference": [], "other": [], "plain": [], "paths": []}
    flips = 0
    for s in range(0, B, k):
        ids, mask = input_ids[s: s + k], attention_mask[s: s + k]
        if k == 1:
            ids = ids[:, mask[0].bool()]
            mask = torch.ones_like(ids)
        ref = teacher_forced_logits(model, ids, mask, tokens[s: s + k], reference)      # (k, M, V)
        oth = teacher_forced_logits(model, ids, mask, tokens[s: s + k], other)          # (k, M', V)
        M = min(ref.shape[1], oth.shape[1])
        ref, oth = ref[:, :M], oth[:, :M]
        dev["paths"].append(deviation(ref, oth).flatten())
        flips += int((ref.argmax(-1) != oth.argmax(-1)).sum())
        for i in range(ids.shape[0]):
            prompt, row = ids[i][mask[i].bool()], tokens[s + i, :M]
            with tf32_off():
                exact = plain_logits(model32, prompt.to(device_of(model32)), row).to(ref.device)   # (M, V)
            dev["reference"].append(deviation(ref[i], exact))
            dev["other"].append(deviation(oth[i], exact))
            dev["plain"].append(deviation(plain_logits(model, prompt, row), exact))
    spread = {key: Spread.of(torch.cat(values)) for key, values in dev.items()}
    return Noise(spread["reference"], spread["other"], spread["paths"], spread["plain"], flips)


def compare_decodings(model, model32, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      reference: list[list[int]], other: list[list[int]], *, exact: bool,
                      paths: Optional[tuple[DecodePath, DecodePath]] = None, noise_rows: int = 16,
                      rows_per_call: Optional[int] = None) -> Verdict:
    """Two greedy decodings of the same left-padded prompts (B, T) judged: divergences with their fp32 margins
    (model32), then judge(). exact: model is fp32 with TF32 off and the tokens must be identical. Else model is the
    bf16 target, and the noise of `paths` (reference's, other's) is measured on the first noise_rows rows, fed the
    reference tokens (cut to the shortest of those rows), rows_per_call at a time (measure_noise). model32 runs with
    TF32 off (tf32_off); model runs in the caller's settings (as its decodings ran)."""
    if not exact and paths is None:
        raise ValueError("a bf16 comparison needs the two DecodePaths whose noise to measure")
    divergences = fp32_margins(model32, input_ids, attention_mask, reference, first_divergences(reference, other))
    if exact:
        return judge(len(reference), divergences, exact=True)
    rows = min(noise_rows, len(reference))
    n = min(len(t) for t in reference[:rows])
    tokens = torch.tensor([t[:n] for t in reference[:rows]], device=input_ids.device)   # (rows, n)
    noise = measure_noise(model, model32, input_ids[:rows], attention_mask[:rows], tokens, *paths, rows_per_call)
    return judge(len(reference), divergences, exact=False, noise=noise)
