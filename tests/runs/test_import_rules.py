"""The layers import one way (docs/design.md): every ``import`` statement of the package,
including those inside functions, read from the source with ``ast``; and strings naming an
m2flow module (a lazy import by name)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "m2flow"
LAYERS = ("pipelines", "envs", "policies", "runs", "embodied", "reasoning", "configs", "cli")
CLI_LEVELS = {  # inside cli/, from the bottom up: a module imports only lower levels
    "m2flow.cli.workloads": 0, "m2flow.cli.planning": 1, "m2flow.cli.common": 2,
    "m2flow.cli.sweep": 3,  # (m2flow-train -m)
    "m2flow.cli.train": 4, "m2flow.cli.eval": 4, "m2flow.cli.plan": 4, "m2flow.cli.demos": 4,
    "m2flow.cli.plot": 4,
}
FOUNDATION = ("keys", "registry", "fields")  # shared by every layer; import no m2flow module

# inside embodied/: a folder -> the other embodied modules it may import (prefixes); the rest
# of embodied/ (config, checks, runner, profile, workload, ...) stands on them. The algorithms'
# helpers use the interface (base) and each other, never an algorithm.
EMBODIED_PARTS = {
    "m2flow.embodied.algorithms.helpers": ("m2flow.embodied.algorithms.base",),
    "m2flow.embodied.algorithms": (),
    "m2flow.embodied.workers": ("m2flow.embodied.algorithms",),
    "m2flow.embodied.demos": (),
}

# top name under m2flow (folder or module) -> the m2flow top names it must never import
FORBIDDEN = {
    "pipelines": {"envs", "policies", "runs", "embodied", "reasoning", "configs"},
    "envs": {"runs", "embodied", "reasoning", "configs"},
    "policies": {"runs", "embodied", "reasoning", "configs"},
    "runs": {"envs", "policies", "embodied", "reasoning", "configs"},
    "configs": {"embodied", "reasoning"},
    "embodied": {"reasoning"},
    "reasoning": {"embodied", "envs", "policies"},
}
for _layer in FORBIDDEN:
    FORBIDDEN[_layer].add("cli")  # the commands are the top


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(package: Path) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports_of(path: Path, package: Path = None, known: set = frozenset()) -> list:
    """(line, module imported, names taken from it) of every m2flow import in ``path``, and of
    every string naming an m2flow module (``"m2flow.embodied.workload:WORKLOAD"``). ``from
    m2flow.a import b`` is an import of module ``m2flow.a.b`` when that is a module in
    ``known``, else of ``m2flow.a`` taking name ``b``."""
    package = package or PACKAGE
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, package)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = me.split(".")[: len(me.split(".")) - node.level + is_pkg]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.append((node.lineno, sub, ()) if sub in known else
                           (node.lineno, src, (a.name,)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("m2flow.") and " " not in node.value:
                out.append((node.lineno, node.value.split(":")[0], ()))
    return [(line, name, names) for line, name, names in out
            if name == "m2flow" or name.startswith("m2flow.")]


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(package: Path = None) -> list[str]:
    """Imports that run back up the layers (between folders, and inside cli/)."""
    package = package or PACKAGE
    known = set(all_modules(package))
    found = []
    for name, path in all_modules(package).items():
        here = top(name)
        banned = FORBIDDEN.get(here, set())
        for line, target, _ in imports_of(path, package, known):
            level, to = CLI_LEVELS.get(name), CLI_LEVELS.get(target)
            upward = level is not None and target.startswith("m2flow.cli") and (
                to is None or to >= level)
            if here in FOUNDATION or top(target) in banned or upward:
                found.append(f"{path.relative_to(package.parent)}:{line} imports {target}")
    return found


def graph(package: Path = None) -> dict[str, set[str]]:
    """module -> the m2flow modules it imports (names resolved to the module defining them
    only as far as the source says: ``from m2flow.pipelines import Channel`` is an arrow to
    ``m2flow.pipelines``)."""
    package = package or PACKAGE
    mods = all_modules(package)
    known = set(mods)
    out = {}
    for name, path in mods.items():
        targets = set()
        for _, target, _ in imports_of(path, package, known):
            while target not in known and "." in target:  # a module's attribute path
                target = target.rsplit(".", 1)[0]
            if target != name and target in known:
                targets.add(target)
        out[name] = targets
    return out


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; an
    import of a package's ``__init__`` from one of its own modules does not count (Python
    runs the ``__init__`` first, whichever comes first)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def edges(v):
        return [w for w in g.get(v, ()) if not v.startswith(w + ".")]

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def private_imports(package: Path = None) -> list[str]:
    """``from m2flow.x import _name`` in another module than ``m2flow.x``: a private name used
    across modules (make it public where it is defined, or move it to its user)."""
    package = package or PACKAGE
    known = set(all_modules(package))
    found = []
    for name, path in all_modules(package).items():
        for line, target, names in imports_of(path, package, known):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != name:
                    found.append(f"{path.relative_to(package.parent)}:{line} imports "
                                 f"{target}.{n}")
    return found


def test_layers_import_one_way():
    assert violations() == []


def embodied_part_violations(package: Path = None) -> list[str]:
    """Imports from algorithms/ (its helpers/ too), workers/ or demos/ into the rest of
    embodied/ (beyond the parts :data:`EMBODIED_PARTS` lets each use)."""
    package = package or PACKAGE
    known = set(all_modules(package))
    found = []
    for name, path in all_modules(package).items():
        part = max((p for p in EMBODIED_PARTS if name == p or name.startswith(p + ".")),
                   key=len, default=None)
        if part is None:
            continue
        allowed = (part, *EMBODIED_PARTS[part])
        for line, target, _ in imports_of(path, package, known):
            if target.startswith("m2flow.embodied") and target != "m2flow.embodied" and \
                    not any(target == a or target.startswith(a + ".") for a in allowed):
                found.append(f"{path.relative_to(package.parent)}:{line} imports {target}")
    return found


def test_embodied_parts_import_down():
    assert embodied_part_violations() == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_no_private_name_crosses_modules():
    assert private_imports() == []


def test_only_the_workload_table_knows_both_workloads():
    both = []
    for name, path in all_modules(PACKAGE).items():
        targets = {top(t) for _, t, _ in imports_of(path, PACKAGE, set(all_modules(PACKAGE)))}
        if {"embodied", "reasoning"} <= targets:
            both.append(str(path.relative_to(PACKAGE)))
    assert both == ["cli/workloads.py"]


def test_every_cli_module_has_a_level():
    assert sorted(n for n in all_modules(PACKAGE) if n.startswith("m2flow.cli.")) == \
        sorted(CLI_LEVELS)


def test_the_checkers_see_what_they_look_for(tmp_path, monkeypatch):
    """The rule tests can fail: planted imports in a copy of the tree are reported."""
    import shutil

    copy = tmp_path / "m2flow"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "reasoning" / "planted.py").write_text(
        "def f():\n    from m2flow.embodied import runner\n    from ..embodied import config\n"
        "    from m2flow.cli import common\n")
    (copy / "cli" / "workloads.py").write_text((copy / "cli" / "workloads.py").read_text() +
                                               "\ndef h():\n    from m2flow.cli import common\n")
    (copy / "keys.py").write_text((copy / "keys.py").read_text() +
                                  "\ndef g():\n    import m2flow.registry\n")
    (copy / "runs" / "planted_a.py").write_text("from m2flow.runs.planted_b import x\n")
    (copy / "runs" / "planted_b.py").write_text(
        "def x():\n    from m2flow.runs import planted_a\n"
        "    from m2flow.runs.logger import _hidden\n")
    (copy / "embodied" / "workers" / "planted_w.py").write_text(
        "from m2flow.embodied.runner import EmbodiedRunner\n")
    (copy / "embodied" / "algorithms" / "helpers" / "planted_h.py").write_text(
        "from m2flow.embodied.algorithms.ppo import PPO\n")
    planted = [v for v in violations(copy) if "planted" in v or "keys" in v or "h()" in v
               or "cli/workloads" in v]
    assert sorted(planted) == sorted(["m2flow/keys.py:" + str(len((copy / "keys.py").read_text().splitlines())
                                                 ) + " imports m2flow.registry",
                       "m2flow/reasoning/planted.py:2 imports m2flow.embodied.runner",
                       "m2flow/reasoning/planted.py:3 imports m2flow.embodied.config",
                       "m2flow/reasoning/planted.py:4 imports m2flow.cli.common",
                       "m2flow/cli/workloads.py:" + str(len((copy / "cli" / "workloads.py")
                                                            .read_text().splitlines()))
                       + " imports m2flow.cli.common"])
    assert ["m2flow.runs.planted_a", "m2flow.runs.planted_b"] in circles(graph(copy))
    assert "m2flow/runs/planted_b.py:3 imports m2flow.runs.logger._hidden" in \
        private_imports(copy)
    assert sorted(embodied_part_violations(copy)) == [
        "m2flow/embodied/algorithms/helpers/planted_h.py:1 imports m2flow.embodied.algorithms.ppo",
        "m2flow/embodied/workers/planted_w.py:1 imports m2flow.embodied.runner"]


@pytest.mark.parametrize("folder", LAYERS)
def test_every_layer_exists(folder):
    assert (PACKAGE / folder / "__init__.py").is_file()
