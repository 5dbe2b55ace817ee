"""An EAGLE-3 head read back beside its target: its feature width and aux layers must be the target's, and a folder
without embed_tokens (a serving export: engines reuse the target's) takes the target's input embeddings, shape-checked
and digest-checked where the export recorded `embed_tokens_sha256`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specdistill.drafts.readback import unfit


def saved_tensor_names(path) -> set[str]:
    """The tensor names stored in a folder's *.safetensors files (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(path).expanduser().glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    return names


def fill_eagle3_embeddings(head, path, target_model, target_name: str = "the target", log=print) -> None:
    """An EAGLE-3 head loaded from `path`: when the folder holds no embed_tokens.weight (engines reuse the target's,
    so exports leave it out), copy the target's input embeddings in, after checking their shape and, where the
    export recorded one, their digest. Raises ValueError naming the folder otherwise."""
    from specdistill.export import embedding_digest

    if "embed_tokens.weight" in saved_tensor_names(path):
        return
    emb = target_model.get_input_embeddings().weight  # (V, H)
    want = tuple(head.embed_tokens.weight.shape)
    if tuple(emb.shape) != want:
        raise unfit(path, target_name, f"the folder has no embed_tokens and the target's embeddings are "
                                       f"{list(emb.shape)}, the head needs {list(want)}")
    recorded = json.loads((Path(path).expanduser() / "config.json").read_text()).get("embed_tokens_sha256")
    if recorded and embedding_digest(emb) != recorded:
        raise unfit(path, target_name, "the folder has no embed_tokens and the target's embeddings differ from the "
                                       f"ones the head was trained with (digest {embedding_digest(emb)} != "
                                       f"{recorded} recorded by the export)")
    with torch.no_grad():
        head.embed_tokens.weight.copy_(emb.detach().to(head.embed_tokens.weight))
    log(f"[draft] {path} has no embed_tokens: using the target's input embeddings ({list(want)}"
        + (", digest matches the export's record)" if recorded else ", shape checked; no digest recorded)"))


def check_eagle3_head(draft, path, target_model, target_name: str = "the target", log=print) -> None:
    """An EAGLE-3 head loaded from `path` against `target_model`: its feature width and aux layers must be the
    target's (else ValueError naming the target it was trained for); it gets the target's embeddings when the folder
    has none (fill_eagle3_embeddings)."""
    c = draft.config
    t = target_model.config.get_text_config()
    if c.target_hidden_size != t.hidden_size:
        raise unfit(path, target_name, f"the head reads target features of width {c.target_hidden_size}, the "
                                       f"target's hidden size is {t.hidden_size}")
    if c.aux_layer_ids and max(c.aux_layer_ids) > t.num_hidden_layers:
        raise unfit(path, target_name, f"the head reads the target's hidden states {list(c.aux_layer_ids)}, the "
                                       f"target has {t.num_hidden_layers} layers")
    fill_eagle3_embeddings(draft, path, target_model, target_name, log)


