"""The layers import one way (docs/design.md): every ``import`` statement of the package,
including those inside functions, read from the source with ``ast``."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "m2flow"
LAYERS = ("pipelines", "envs", "policies", "runs", "embodied", "reasoning", "configs")

# folder -> the m2flow folders it must never import
FORBIDDEN = {
    "pipelines": {"envs", "policies", "runs", "embodied", "reasoning", "configs", "cli"},
    "envs": {"runs", "embodied", "reasoning", "configs", "cli"},
    "policies": {"runs", "embodied", "reasoning", "configs", "cli"},
    "runs": {"envs", "policies", "embodied", "reasoning", "configs", "cli"},
    "configs": {"embodied", "reasoning", "cli"},
    "embodied": {"reasoning", "cli"},
    "reasoning": {"embodied", "envs", "policies", "cli"},
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top folder under m2flow) of every m2flow import in ``path``, and of every
    string naming an m2flow module (``"m2flow.embodied.workload:WORKLOAD"``: a lazy import)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            if names[0] == "m2flow":  # from m2flow import embodied
                names = [f"m2flow.{a.name}" for a in node.names]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("m2flow.") and " " not in node.value:
                names = [node.value.split(":")[0]]
        for name in names:
            parts = name.split(".")
            if parts[0] == "m2flow" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = path.relative_to(PACKAGE).parts[0]
        banned = FORBIDDEN.get(folder, set())
        for line, target in imports_of(path):
            if target in banned:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports m2flow.{target}")
    return found


def test_layers_import_one_way():
    assert violations() == []


def test_only_the_cli_knows_both_workloads():
    both = []
    for path in sorted(PACKAGE.rglob("*.py")):
        targets = {t for _, t in imports_of(path)}
        if {"embodied", "reasoning"} <= targets:
            both.append(str(path.relative_to(PACKAGE)))
    assert both == ["cli.py"]


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The rule test can fail: a planted import in a copy of the tree is reported."""
    import shutil

    copy = tmp_path / "m2flow"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "reasoning" / "planted.py").write_text(
        "def f():\n    from m2flow.embodied import runner\n    from ..embodied import config\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PACKAGE", copy)
    planted = [v for v in violations() if "planted" in v]
    assert planted == ["m2flow/reasoning/planted.py:2 imports m2flow.embodied",
                       "m2flow/reasoning/planted.py:3 imports m2flow.embodied"]


@pytest.mark.parametrize("folder", LAYERS)
def test_every_layer_exists(folder):
    assert (PACKAGE / folder / "__init__.py").is_file()
