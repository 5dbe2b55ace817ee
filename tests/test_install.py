"""A non-editable `pip install .` into a fresh venv runs a recipe outside the checkout (conf/, recipes/ in the
wheel)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.test_entry_points import console_scripts

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _dependency_dirs() -> list[str]:
    """The site-packages folders the running interpreter takes torch, transformers... from (not the checkout)."""
    # A venv inside the checkout (.venv, as scripts/setup.sh makes it) is a dependency folder like any other: its
    # editable-install hook is a .pth, which a path listed in our .pth does not run.
    return [p for p in sys.path if Path(p).is_dir() and Path(p).name in ("site-packages", "dist-packages")]


def _run(cmd: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:4]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_pip_install_into_a_fresh_venv_runs_the_kd_recipe(tiny_target_dir, tiny_data_file, tmp_path):
    # The sources are copied first: pip builds in the source tree (build/, *.egg-info); the checkout stays untouched.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("specdistill", "conf", "recipes"):
        shutil.copytree(REPO / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    # A fresh venv without pip; its dependencies come from this interpreter's site-packages through a .pth of plain
    # paths (a .pth inside those folders is not run, so an editable install of the checkout there stays inactive).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, 120)
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, 60)
                .stdout.strip())
    (site / "_specdistill_test_deps.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", src], tmp_path, 300)
    installed = {f.name for f in (venv / "bin").glob("specdistill-*")}
    assert installed == set(console_scripts()), sorted(installed)  # the user commands, no experiment harness

    work = tmp_path / "elsewhere"  # neither the checkout nor the copied sources are on the path from here
    work.mkdir()
    where = json.loads(_run([py, "-c", "import json, sys, specdistill.config as c; print(json.dumps("
                             "[c.__file__, str(c.CONF_DIR), sys.path]))"], work, 60).stdout)
    assert Path(where[0]).resolve().is_relative_to(site.resolve()), where[0]
    assert Path(where[1], "config.yaml").is_file() and Path(where[1]).parent.joinpath("recipes", "kd.yaml").is_file()
    # the checkout's sources are not importable (a .venv inside the checkout only provides the dependencies)
    assert not any(p and (Path(p) / "specdistill" / "__init__.py").resolve().is_relative_to(REPO / "specdistill")
                   for p in where[2]), where[2]

    out = tmp_path / "run"
    over = tiny_overrides(tiny_target_dir, tiny_data_file, out, tmp_path / "cache") + ["trainer.max_steps=2"]
    _run([venv / "bin" / "specdistill-train", "recipe=kd", *over], work, 400)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 2
    assert (out / "checkpoints" / "step-0000002" / "draft" / "model.safetensors").exists()
