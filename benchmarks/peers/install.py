"""One virtual environment per peer trainer under ~/.cache/specdistill/peers/<peer>/venv, pinned and idempotent.

Each venv gets the CPU torch wheel (constraints/cpu.txt), the dependencies its EAGLE-3 training path imports, and the
peer itself with --no-deps: the peers declare pins we override on purpose (SpecForge: torch 2.11 and sglang, which
pull a CUDA build; speculators: torchvision / torchaudio, which it does not import on this path; ModelOpt: its
optional `hf` extra's deepspeed / diffusers / peft). A `installed.json` beside the venv records the exact requirement
list; a venv whose record matches is reused as it is, another is rebuilt.

    python -m benchmarks.peers.install [--peer speculators] [--force]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_CONSTRAINTS = REPO / "constraints" / "cpu.txt"


def peers_root() -> Path:
    return Path(os.environ.get("SPECDISTILL_PEERS_DIR", "~/.cache/specdistill/peers")).expanduser()


@dataclass(frozen=True)
class PeerSpec:
    name: str
    package: str  # the peer, installed with --no-deps
    deps: tuple[str, ...]  # what its EAGLE-3 path imports, resolved normally under the CPU constraints
    no_deps: tuple[str, ...] = ()  # further packages taken without their declared dependencies
    imports: tuple[str, ...] = ()  # modules that must import once installed (the check that the venv works)
    notes: tuple[str, ...] = field(default_factory=tuple)


PEERS: dict[str, PeerSpec] = {
    "speculators": PeerSpec(
        "speculators", "speculators==0.9.0",
        deps=("transformers==5.19.0", "datasets>=4.0,<=5.1.0", "pydantic>=2", "pydantic-settings>=2",
              "loguru==0.7.3", "openai>=2", "numpy>=2,<=2.5.4", "safetensors", "tqdm", "rich", "typer>=0.12",
              "click", "psutil", "httpx", "huggingface-hub", "protobuf", "aiohttp", "packaging"),
        no_deps=("hs-connectors==0.9.0",),
        imports=("speculators.train.cli", "speculators.models.eagle3", "hs_connectors"),
        notes=("transformers <= 5.19 (its pin); torchvision / torchaudio left out "
               "(not imported by EAGLE-3 training)",)),
    "specforge": PeerSpec(
        "specforge", "specforge==0.2.0",
        deps=("transformers==5.8.1", "datasets", "accelerate", "pydantic>=2", "pyyaml", "psutil", "safetensors",
              "requests", "tqdm", "numpy", "huggingface-hub", "typing-extensions", "packaging"),
        # specforge.algorithms.eagle3.model imports triton: it loads after shims/specforge.py, not here
        imports=("specforge.modeling.draft.llama3_eagle", "specforge.algorithms.eagle3.data", "specforge.optimizer"),
        notes=("torch 2.11 and sglang 0.5.14 pins overridden: offline training needs neither",)),
    "modelopt": PeerSpec(
        "modelopt", "nvidia-modelopt==0.47.0",
        deps=("transformers==5.14.1", "accelerate", "pydantic>=2", "omegaconf>=2.3", "pulp<4", "regex", "rich",
              "safetensors", "scipy", "numpy", "packaging", "tqdm", "pyyaml", "ninja", "nvidia-ml-py>=12",
              "setuptools>=80", "requests"),
        imports=("modelopt.torch.speculative",),
        notes=("transformers < 5.15 (what its EAGLE plugin supports)",)),
}


def venv_dir(peer: str) -> Path:
    return peers_root() / peer / "venv"


def venv_python(peer: str) -> Path:
    return venv_dir(peer) / "bin" / "python"


def _record(spec: PeerSpec) -> dict:
    """What a venv was made from, as its JSON reads back (tuples as lists), so a record compares equal to itself."""
    rec = {"spec": asdict(spec), "torch": CPU_CONSTRAINTS.read_text().split("torch==")[-1].split()[0],
           "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    return json.loads(json.dumps(rec))


def is_installed(peer: str) -> bool:
    rec = peers_root() / peer / "installed.json"
    if not (rec.exists() and venv_python(peer).exists()):
        return False
    try:
        return json.loads(rec.read_text()) == _record(PEERS[peer])
    except ValueError:
        return False


def _pip(py: Path, *args: str) -> None:
    cmd = ["nice", "-n", "19", str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    print("[peers/install]", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True)


def install(peer: str, force: bool = False) -> Path:
    """The peer's venv python, installed if missing or made from another requirement list."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}: choose one of {sorted(PEERS)}")
    spec = PEERS[peer]
    if not force and is_installed(peer):
        print(f"[peers/install] {peer}: up to date in {venv_dir(peer)}", flush=True)
        return venv_python(peer)
    root = peers_root() / peer
    (root / "installed.json").unlink(missing_ok=True)  # recorded again only once every step succeeded
    if venv_dir(peer).exists():
        shutil.rmtree(venv_dir(peer))
    root.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv_dir(peer))], check=True)
    py = venv_python(peer)
    constraints = ("-c", str(CPU_CONSTRAINTS))
    _pip(py, *constraints, "torch")
    _pip(py, *constraints, *spec.deps)  # torch is installed: nothing here can pull another build
    _pip(py, "--no-deps", *spec.no_deps, spec.package)
    check = "; ".join(f"import {m}" for m in spec.imports) + "; import torch; print(torch.__version__)"
    out = subprocess.run([str(py), "-c", check], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0 or "+cpu" not in out.stdout:
        raise RuntimeError(f"{peer}: the venv {venv_dir(peer)} does not import {list(spec.imports)} on the CPU "
                           f"torch:\n{out.stderr[-3000:]}{out.stdout[-500:]}")
    (root / "installed.json").write_text(json.dumps(_record(spec), indent=1))
    print(f"[peers/install] {peer}: installed in {venv_dir(peer)} (torch {out.stdout.strip().splitlines()[-1]})",
          flush=True)
    return py


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", action="append", choices=sorted(PEERS), help="install only this peer (repeatable)")
    ap.add_argument("--force", action="store_true", help="rebuild the venv even when its record matches")
    args = ap.parse_args(argv)
    for peer in args.peer or sorted(PEERS):
        install(peer, force=args.force)


if __name__ == "__main__":
    main()
