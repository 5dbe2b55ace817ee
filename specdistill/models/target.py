"""The frozen target model: one forward gives its logits and (for EAGLE-3) the aux hidden states."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from specdistill.assets import is_embedded, resolve_model_path
from specdistill.models.attention import use_grouped_sdpa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def parse_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def locate_model(path: str) -> str:
    """Resolve `embedded:*` and check a local-looking path exists, with an error that says what to do."""
    if is_embedded(path):
        return resolve_model_path(path)
    p = Path(path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model folder {p} has no config.json: point target.path/draft.path at an HF "
                                    "model folder (save_pretrained output)")
        return str(p)
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"model path {path!r} does not exist. Use a local HF folder, a hub id (org/name) with "
                                "network access, or target.path=embedded:smollm2-135m-instruct")
    return path  # a hub id; from_pretrained raises its own error, which load_causal_lm rewords


class NotACausalLM(ValueError):
    """A folder given as a target that is not a causal LM checkpoint (a draft head, or one missing its weights)."""


DRAFT_FOLDERS = "a draft is evaluated with eval.draft_path, warm-started with draft.path"


def not_a_causal_lm(config: dict) -> Optional[str]:
    """Why a model whose config.json is `config` is not a causal LM checkpoint transformers can load whole, or None.
    A draft's folder (an EAGLE-3 head, a DFlash drafter) given as target.path is refused before this, naming its kind
    (validation asks the draft kinds, which this package knows nothing of); here its architectures name no causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = [str(a) for a in config.get("architectures") or []]
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs and not any(a in known or a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
                         for a in archs):
        return f"architectures {archs} name no causal LM that transformers' AutoModelForCausalLM loads"
    return None


def refusal(path, why: str, setting: str = "target.path") -> str:
    """The message refusing the model at `path`, given as `setting`, that is `why` and not a causal LM checkpoint."""
    return (f"{setting}={str(path)!r} is {why}. Point {setting} at the causal LM checkpoint (an HF folder or hub id "
            f"with its decoder weights); {DRAFT_FOLDERS}")


def check_causal_lm(path: str, config: dict, setting: str = "target.path") -> None:
    """Raise NotACausalLM naming `setting` when the model at `path` (its config.json as `config`) is not one."""
    why = not_a_causal_lm(config)
    if why:
        raise NotACausalLM(refusal(path, why, setting))


def _config_dict(where: str) -> dict:
    """config.json of a local folder, read directly: a draft's config may name a model_type AutoConfig refuses."""
    import json

    f = Path(where) / "config.json"
    if f.is_file():
        try:
            return json.loads(f.read_text())
        except ValueError as e:
            raise ValueError(f"{f} is not valid JSON ({e}): the model folder is damaged") from None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(where).to_dict()  # a hub id


def enable_tf32() -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (CUDA; nothing elsewhere): fp32 drafts and the fp32 parts
    of mixed precision run several times faster, at about bf16's mantissa."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def load_causal_lm(path: str, dtype: str = "float32", device_map: Optional[str] = None, setting: str = "target.path"):
    """A causal LM from an HF folder or hub id. Every command loads its models through here, so this is also where
    a run turns on TF32, and where a grouped-query model that loaded with "sdpa" switches to models/attention.py's
    GROUPED_SDPA (the same attention without copying the cache). device_map="auto" spreads its layers over the
    machine's GPUs (target.shard=device_map). A folder that is no causal LM checkpoint (a draft head) or lacks
    weights is refused, naming `setting`."""
    from transformers import AutoModelForCausalLM

    enable_tf32()
    where = locate_model(path)
    placement = {"device_map": device_map} if device_map else {}
    try:
        check_causal_lm(path, _config_dict(where), setting)
        model, info = AutoModelForCausalLM.from_pretrained(where, dtype=parse_dtype(dtype), output_loading_info=True,
                                                           **placement)
    except OSError as e:
        raise FileNotFoundError(
            f"could not load model {path!r} ({type(e).__name__}: {str(e).splitlines()[0]}). Offline machines cannot "
            "reach the hub: download it elsewhere and pass the local folder, or use embedded:smollm2-135m-instruct"
        ) from None
    except RuntimeError as e:
        if "mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise
        raise NotACausalLM(f"{setting}={str(path)!r}: its config.json disagrees with the shapes of its tensors "
                           "(transformers' load report above lists each one, checkpoint against config): the config "
                           "belongs to another model or was edited; restore the config.json saved with these "
                           "weights") from None
    check_weights_complete(path, info, setting)
    use_grouped_sdpa(model)  # attention reads a grouped-query cache without repeating it (models/attention.py)
    return model


def check_weights_complete(path: str, info: dict, setting: str = "target.path") -> None:
    """Raise NotACausalLM when from_pretrained's loading info lists weights the checkpoint lacks (transformers fills
    them at random and only warns): a model with random layers must not train or score a draft."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise NotACausalLM(f"{setting}={str(path)!r} lacks {len(missing)} of its model's weights ({shown}); "
                           "transformers would start them at random. Point it at a complete checkpoint (all its "
                           f"*.safetensors shards and the index); {DRAFT_FOLDERS}")


def load_target_config(path: str):
    """The target's HF config alone (config.json, no weights), for checks before anything loads."""
    from transformers import AutoConfig

    where = locate_model(path)
    check_causal_lm(path, _config_dict(where))
    return AutoConfig.from_pretrained(where)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(locate_model(path))


def cap_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """The model's final-logit soft cap, cap * tanh(logits / cap), where its config has one (Gemma-2/3:
    final_logit_softcapping); identity otherwise. (..., V) -> (..., V). HF applies it inside the model's forward, so
    logits rebuilt from stored hidden states need it to be the logits the model really emits."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


def output_logits(model, h: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's logits from its final (normed) hidden states h (..., H): output layer, bias and soft cap as its
    forward applies them. rows (V,) bool: only those vocabulary rows (..., Vr), V/Vr times fewer FLOPs."""
    head = model.get_output_embeddings()
    h = h.to(head.weight.dtype)
    if rows is None:
        return cap_logits(head(h), model.config)
    logits = h @ head.weight[rows].T
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[rows]
    return cap_logits(logits, model.config)  # element-wise, so capping the kept rows equals restricting capped logits


def embedding_scale(model) -> float:
    """The scalar the model's input embedding module multiplies its weight rows by (Gemma: sqrt(hidden), as
    Gemma3TextScaledWordEmbedding does; 1.0 for plain nn.Embedding), measured by calling the module, so a head that
    embeds tokens with the target's weight and this scale embeds them exactly as the target does. Raises when the
    module is not a scaled lookup (a head cannot reproduce it from the weight)."""
    emb = model.get_input_embeddings()
    ids = torch.arange(min(8, emb.weight.shape[0]), device=emb.weight.device)
    with torch.no_grad():
        out, raw = emb(ids).float(), emb.weight[ids].float()  # (n, H) each
    nz = raw.abs() > 1e-12
    ratio = out[nz] / raw[nz]
    scale = float(ratio.median()) if ratio.numel() else 1.0
    if not torch.allclose(out, raw * scale, rtol=1e-2, atol=1e-6):
        raise ValueError(f"the target's input embedding ({type(emb).__name__}) is not a scaled lookup of its weight "
                         "rows, so an EAGLE-3 head cannot embed tokens as the target does; this architecture is not "
                         "supported for draft=eagle3 (use an LM draft: draft=from_target)")
    return 1.0 if abs(scale - 1.0) < 1e-6 else scale


def shard_target(target: "Target") -> None:
    """target.shard=fsdp: each decoder layer of the frozen target split over the processes of the launch (FSDP2
    fully_shard, over the default process group), so a process holds about 1/N of the layers' weights and gathers one
    layer at a time in a forward. The embeddings, final norm and output layer stay whole on every process: heads and
    stored-feature logits read them directly. Every forward is then collective: the processes must call the target
    the same number of times."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    blocks = set(getattr(target.model, "_no_split_modules", None) or ())
    layers = [m for m in target.model.modules() if type(m).__name__ in blocks or isinstance(m, FSDPModule)]
    if not layers:
        raise ValueError(f"target.shard=fsdp: {type(target.model).__name__} names no decoder layer class "
                         "(_no_split_modules) to shard; use target.shard=none or device_map")
    for m in layers:
        if not isinstance(m, FSDPModule):  # sharded once: placing the target again changes nothing
            fully_shard(m)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (B, T, V)
    aux_hidden: Optional[torch.Tensor] = None  # (B, T, n_aux * H): concatenated aux layers, ascending ids


@dataclass
class DraftVocabTarget:
    logits: torch.Tensor  # (N, Vd) target logits over the draft vocabulary at the selected positions
    in_vocab: torch.Tensor  # (N,) bool: the target's full-vocabulary argmax is in the draft vocabulary
    aux_hidden: Optional[torch.Tensor] = None  # (B, T, n_aux * H) at every position


class Target(torch.nn.Module):
    """A frozen causal LM in eval mode. `aux_layer_ids` follow vLLM: k = residual stream after k decoder layers
    = HF output_hidden_states[k] (0 is the embeddings)."""

    def __init__(self, model, aux_layer_ids: Optional[list[int]] = None):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.aux_layer_ids = None
        if aux_layer_ids:
            self.set_aux_layer_ids(aux_layer_ids)

    def set_aux_layer_ids(self, ids: list[int]) -> None:
        L = self.model.config.num_hidden_layers
        bad = [k for k in ids if not 0 <= k < L]
        if bad:
            # k = L is excluded: HF's hidden_states[L] is after the final norm, vLLM's stream L is before it.
            raise ValueError(f"target.aux_layer_ids {bad} out of range for a target with {L} layers: use ids in "
                             f"[0, {L - 1}] (vLLM convention: k = hidden_states[k], 0 = the embeddings)")
        self.aux_layer_ids = list(ids)

    @property
    def config(self):
        return self.model.config

    def train(self, mode: bool = True):  # the target never leaves eval mode
        return super().train(False)

    @torch.no_grad()
    def from_features(self, final_hidden, aux_hidden=None, logits_to_keep=0) -> TargetOutput:
        """Rebuild the output from stored features (data/features.py): logits = lm_head(final normed hidden)."""
        h = final_hidden if isinstance(logits_to_keep, int) and logits_to_keep == 0 else final_hidden[:, logits_to_keep]
        dtype = self.model.get_output_embeddings().weight.dtype
        aux = aux_hidden.to(dtype) if aux_hidden is not None else None  # stored as bf16
        return TargetOutput(logits=output_logits(self.model, h), aux_hidden=aux)

    @torch.no_grad()
    def draft_vocab_outputs(self, batch: dict, positions: torch.Tensor, t2d: torch.Tensor) -> "DraftVocabTarget":
        """The target's distribution at `positions` (B, T) bool, restricted to the draft vocabulary t2d (V,) bool,
        plus whether its argmax is in that vocabulary, and the aux hidden states (B, T, A) at every position.

        From stored features this rebuilds only the Vd kept rows of the output layer (V/Vd times fewer FLOPs than
        full logits); the argmax comes from the stored `target_argmax` when the batch has it (regenerated greedy
        data: the target's argmax is the token it emitted), else from full logits at `positions` only."""
        from specdistill.models.vocab import restrict_to_draft_vocab

        if "final_hidden" in batch:
            h = batch["final_hidden"][positions]  # (N, Ht)
            if "target_argmax" in batch:
                logits = output_logits(self.model, h, rows=t2d)  # (N, Vd): only the kept rows of the output layer
                in_vocab = t2d[batch["target_argmax"][positions]]  # (N,)
            else:
                logits, in_vocab = restrict_to_draft_vocab(output_logits(self.model, h), t2d)
            aux = batch.get("aux_hidden")
            aux = aux.to(logits.dtype) if aux is not None else None
        else:
            out = self(batch["input_ids"], batch["attention_mask"])
            logits, in_vocab = restrict_to_draft_vocab(out.logits[positions], t2d)  # (N, Vd), (N,)
            aux = out.aux_hidden
        return DraftVocabTarget(logits=logits, in_vocab=in_vocab, aux_hidden=aux)

    def outputs(self, batch: dict, logits_to_keep=0) -> TargetOutput:
        """The target's output for a training batch: from stored features when the batch carries them, else a
        forward pass."""
        if "final_hidden" in batch:
            return self.from_features(batch["final_hidden"], batch.get("aux_hidden"), logits_to_keep)
        return self(batch["input_ids"], batch["attention_mask"], logits_to_keep=logits_to_keep)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, logits_to_keep=0) -> TargetOutput:
        want_aux = self.aux_layer_ids is not None
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=want_aux,
                         use_cache=False, logits_to_keep=logits_to_keep)
        aux = torch.cat([out.hidden_states[k] for k in self.aux_layer_ids], dim=-1) if want_aux else None
        return TargetOutput(logits=out.logits, aux_hidden=aux)
