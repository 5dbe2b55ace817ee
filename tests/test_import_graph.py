"""Packages import downward only: the package-level import graph of specdistill/ (imports inside functions count)
has no cycle, nothing in it imports the folders above it (benchmarks/, scripts/, tests/), and no draft-kind type check
lives outside the draft adapters."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specdistill"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _unit(module: str) -> str:
    """specdistill.a.b -> specdistill.a: the top-level subpackage (or top-level module) a module belongs to."""
    return ".".join(module.split(".")[:2])


def import_graph() -> dict[str, set[str]]:
    """Top-level unit -> the units it imports (anywhere in its files, function bodies included)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        src = _unit(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against this module
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                targets = [".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, ast.ImportFrom):
                targets = [node.module or ""]
            else:
                continue
            for t in targets:
                if t.startswith("specdistill.") and _unit(t) != src:
                    edges.setdefault(src, set()).add(_unit(t))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_package_level_import_cycle():
    found = cycles(import_graph())
    assert not found, ("package-level import cycles (move the helper that closes each one down to the lowest "
                       f"package both sides may import): {found}")


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_nothing_below_the_pipeline_imports_it():
    """The entry points (cli/) sit on top of the stages; every other package sits below them."""
    importers = sorted(u for u, deps in import_graph().items()
                       if "specdistill.pipeline" in deps and u != "specdistill.cli")
    assert importers == [], f"{importers} import specdistill.pipeline, the top stage package"


# Folders above the package: experiments, scripts and tests import specdistill, never the reverse.
ABOVE_THE_PACKAGE = ("benchmarks", "scripts", "tests")


def upward_imports(root: Path = PACKAGE) -> list[str]:
    """package file:line -> a module of a folder above the package (benchmarks/, scripts/, tests/)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in ABOVE_THE_PACKAGE]
    return found


def test_the_package_imports_no_experiment_script_or_test():
    offenders = upward_imports()
    assert not offenders, f"specdistill/ must not import benchmarks/, scripts/ or tests/: {offenders}"


def test_the_upward_import_check_catches_each_form(tmp_path):
    (tmp_path / "a.py").write_text("import benchmarks.recipes\nfrom tests.conftest import compose\n"
                                   "def f():\n    from scripts import x\n")
    (tmp_path / "b.py").write_text("import benchmarking\nfrom specdistill.eval import compare\nfrom . import tests\n")
    assert upward_imports(tmp_path) == ["a.py:1: benchmarks.recipes", "a.py:2: tests.conftest", "a.py:4: scripts"]


# Draft-kind dispatch written by hand: every pattern below has been seen outside drafts/ at some point.
KIND_CHECKS = re.compile(
    r"is_eagle3\("                                          # a kind predicate
    r"|isinstance\([^)]*Eagle3Head"                         # a type check on the head
    r"|[=!]=\s*[\"']eagle3[\"']|[\"']eagle3[\"']\s*[=!]="   # comparing a string with the kind's name
    r"|\bin\s*[(\[{][^)\]}]*[\"']eagle3[\"']"               # membership in a literal holding it
    r"|[\"']draft=eagle3[\"']\s+(not\s+)?in\b"               # sniffing a variant's overrides for the kind
    r"|[\"']LlamaForCausalLMEagle3[\"']\s+(not\s+)?in\b"     # sniffing a saved folder's architecture
    r"|\.kind\s*[=!]=|\.kind\]"                             # branching on, or indexing by, DraftAdapter.kind
    r"|export_eagle3\("                                     # the head's export, bypassing DraftKind.export
)
# drafts/ is where kinds are told apart: each kind's folder (drafts/eagle3/, drafts/dflash/) holds its model, drafter,
# adapter and serving formats, which are that kind's implementation, not dispatch.
KIND_OWNERS = ("drafts/",)


def kind_check_offenders(root: Path = PACKAGE) -> list[str]:
    return [f"{path.relative_to(root)}:{n + 1}: {line.strip()}"
            for path in sorted(root.rglob("*.py")) if not path.relative_to(root).as_posix().startswith(KIND_OWNERS)
            for n, line in enumerate(path.read_text().splitlines()) if KIND_CHECKS.search(line)]


def test_no_draft_kind_type_checks_outside_the_adapters():
    """Dispatch on draft kinds goes through drafts/ (DraftAdapter), not isinstance checks or init-name branches."""
    offenders = kind_check_offenders()
    assert not offenders, offenders


def test_the_kind_check_catches_the_patterns_it_names(tmp_path):
    lines = ['if is_eagle3(model):', 'if isinstance(m, Eagle3Head):', 'if init == "eagle3":',
             'if cfg.draft.init in ("pretrained", "eagle3"):', 'head = recipe == "eagle3" or "draft=eagle3" in extra',
             'if "LlamaForCausalLMEagle3" in archs:', 'if adapter.kind == "draft":', 'TABLE[adapter.kind](x)',
             'export_eagle3(src, dst)']
    clean = ['kind = kind_for_init(init)', 'VARIANTS = {"eagle3": ("eagle3", [])}', 'OFF_POLICY[a.data_objective]']
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "bad.py").write_text("\n".join(lines))
    (pkg / "good.py").write_text("\n".join(clean))
    (pkg / "drafts").mkdir()
    (pkg / "drafts" / "owner.py").write_text("\n".join(lines))
    found = kind_check_offenders(pkg)
    assert [f.split(":")[1] for f in found] == [str(i + 1) for i in range(len(lines))], found
    assert all(f.startswith("bad.py") for f in found)
