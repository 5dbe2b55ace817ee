"""The console commands pyproject.toml installs are the user's commands: each names the main() of a module under
specdistill/cli/, and none is an experiment harness (those run from the checkout: python -m benchmarks.<name>)."""
import importlib
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USER_COMMANDS = {"train", "evaluate", "export", "regenerate", "moefy", "compare"}


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_the_console_commands_are_the_user_commands():
    names = set(console_scripts())
    assert names == {f"specdistill-{c}" for c in USER_COMMANDS}, sorted(names)


def test_each_console_command_names_a_main_under_cli():
    for name, target in console_scripts().items():
        module, _, attr = target.partition(":")
        assert module.startswith("specdistill.cli.") and attr == "main", f"{name} = {target}"
        assert callable(getattr(importlib.import_module(module), attr)), f"{name}: {target} is not callable"


def test_every_experiment_harness_is_a_module_of_benchmarks():
    """No harness is left inside the package; each one runs as python -m benchmarks.<name>."""
    package = {p.stem for p in (REPO / "specdistill").rglob("*.py")}
    assert not package & {"bench", "bench_moe", "moe_bench"}, sorted(package & {"bench", "bench_moe", "moe_bench"})
    for name in ("recipes", "moe"):
        assert callable(importlib.import_module(f"benchmarks.{name}").main)
