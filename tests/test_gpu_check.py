"""scripts/gpu_check.py's CPU fallback (--device cpu --tiny) runs every stage at toy sizes and passes, its compiled-
decoding checks included, on a stand-in for torch.compile (the plumbing, not inductor). ~20 s: two train.py runs."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_the_gpu_check_passes_on_the_cpu_at_toy_sizes(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--compile", "on", "--budget-s", "1000",
                         "--work", str(tmp_path / "work"), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = report["stages"]
    assert rc == 0 and report["ok"] and report["problems"] == [], json.dumps(stages, indent=1)[:4000]
    assert set(stages) == {"assets", "eagle3", "draft_opd", "evaluate", "regenerate"}
    assert stages["eagle3"]["steps"] == 2 and stages["eagle3"]["tokens_per_s"] > 0
    assert stages["draft_opd"]["steps"] == 1
    assert stages["evaluate"]["compiled"]["prompts"] == 1 and stages["evaluate"]["speedup"] > 0
    assert stages["regenerate"]["batch4_compiled_tokens_per_s"] > 0
