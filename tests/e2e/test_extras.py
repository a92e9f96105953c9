"""`pip install m2flow` is the engine; each simulator and model stack is an extra
(`m2flow[maniskill]`, `[libero]`, `[mjlab]`, `[vla]`, `[reasoning]`, `[all]`).

What makes that true: no module of m2flow imports a stack when it is imported (read from the
source, and shown by a process in which the stacks are not found: tests/stacks.py), each stack
names the extra that installs it, and a run that picks a stack that is not installed is refused
at start-up in one line with the pip command. The reasoning run of
tests/e2e/test_fingerprint.py runs in such a process too, on Ray, to its recorded numbers.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from tests.stacks import REPO_ROOT, STACKS, without_stacks

PACKAGE = REPO_ROOT / "m2flow"
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def dist(requirement: str) -> str:
    """The normalised distribution name of a requirement: 'Mani_Skill>=3' -> 'mani-skill'."""
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


@functools.cache
def _providers() -> dict[str, list[str]]:
    return packages_distributions()  # reads every installed distribution's file list: once


def dists_of(module: str) -> set[str]:
    """The installed distributions that provide top-level module ``module``."""
    return {dist(d) for d in _providers().get(module, ())}


def import_time_modules(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports when it is imported: its module body's
    import statements (also under ``if`` and ``try``), not those inside functions or classes."""
    found = set()

    def walk(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
            elif isinstance(node, (ast.If, ast.Try)):
                for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                              *(h.body for h in getattr(node, "handlers", []))):
                    walk(block)

    walk(ast.parse(path.read_text(), filename=str(path)).body)
    return found


def test_modules_import_only_core_dependencies_at_import_time():
    core = {dist(r) for r in PROJECT["dependencies"]}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for top in sorted(import_time_modules(path) - set(sys.stdlib_module_names) - {"m2flow"}):
            if not dists_of(top) & core:
                wrong.append(f"{path.relative_to(REPO_ROOT)}: {top} ({dists_of(top) or '?'})")
    assert not wrong, ("imported at import time but not a core dependency (import it where it "
                       f"is used, and list it in its extra): {wrong}")


def test_every_stack_names_an_extra_that_installs_it():
    """Each registered env and policy that needs packages beyond the core names an extra whose
    requirements provide every module it needs; ``all`` is every extra but ``dev``, and
    scripts/install.sh installs it."""
    from m2flow.envs.registry import ENVS
    from m2flow.policies.registry import POLICIES

    seen = set()
    for registry in (ENVS, POLICIES):
        for name in registry.names():
            requires = getattr(registry.load(name), "requires", None)
            if requires is None:
                continue
            extra = re.fullmatch(r"m2flow\[(\w+)\]", requires.install)
            assert extra and extra[1] in EXTRAS, (name, requires.install)
            listed = {dist(r) for r in EXTRAS[extra[1]]}
            for module in requires.modules:
                assert dists_of(module) & listed, f"{name}: {module} is not in [{extra[1]}]"
            seen.add(extra[1])
    assert seen == {"maniskill", "libero", "mjlab", "metaworld", "vla"}, seen
    assert EXTRAS["all"] == [f"m2flow[{','.join(e for e in EXTRAS if e not in ('dev', 'all'))}]"]
    assert '-e ".[dev,all]"' in (REPO_ROOT / "scripts" / "install.sh").read_text()
    stack_dists = {dist(r) for e in ("maniskill", "libero", "mjlab", "metaworld", "vla")
                   for r in EXTRAS[e]}
    assert not stack_dists & {dist(r) for r in PROJECT["dependencies"]}


PROBE = r"""
import contextlib, importlib, io, json, pkgutil, sys
import m2flow
modules = [m.name for m in pkgutil.walk_packages(m2flow.__path__, "m2flow.")]
for name in modules:
    importlib.import_module(name)  # every module of m2flow imports

from m2flow.cli.common import load_run_config
from m2flow.cli.train import main as train
from m2flow.embodied.algorithms import registered_algorithms
from m2flow.envs import registered_envs
from m2flow.policies import registered_policies
from m2flow.reasoning.model import load_model
from m2flow.reasoning.reward import reward_fn

cfg = load_run_config("reasoning_arith_grpo_tiny", ["runner.num_steps=1"])  # composed, checked
model, tok = load_model(cfg.model)  # the tiny Qwen2 and its tokenizer (transformers)
ids = tok("12+7=", return_tensors="pt")["input_ids"]
logits = model(ids).logits
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = train([])  # the default job, on ManiSkill
ray = sys.modules.get("ray")
print(json.dumps({
    "modules": len(modules) + 1, "envs": registered_envs(), "policies": registered_policies(),
    "algorithms": registered_algorithms(), "logits": list(logits.shape),
    "expected_shape": [1, ids.shape[1], len(tok)],
    "reward": reward_fn(cfg.algorithm.reward)("12+7=19", "19"), "code": code,
    "stderr": err.getvalue(), "ray_started": bool(ray and ray.is_initialized()),
}))
"""


def test_m2flow_and_the_reasoning_workload_need_no_stack(tmp_path):
    """In a process where no stack is found: every module imports, the registries list their
    names, the reasoning tiny config composes and its model scores a prompt; the default job
    (ManiSkill) is refused before Ray starts, in one line naming the extra to install."""
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=without_stacks(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["modules"] == len(list(PACKAGE.rglob("*.py")))
    assert {"ManiSkill/*", "LIBERO/*", "mjlab/*", "gym/*"} <= set(r["envs"])
    assert {"mlp", "cnn", "openvla_oft"} <= set(r["policies"])
    assert {"ppo", "grpo", "bc", "sac"} <= set(r["algorithms"])
    assert r["logits"] == r["expected_shape"] and r["reward"] == 1.0
    assert r["code"] == 2 and not r["ray_started"]
    assert r["stderr"].splitlines() == [
        "m2flow-train: config error: env 'ManiSkill/PushCube-v1' needs mani_skill, sapien, "
        "which are not installed: pip install 'm2flow[maniskill]'."]
    assert list(tmp_path.iterdir()) == [tmp_path / "site"], "a refused run wrote files"


def test_the_blocker_hides_exactly_the_stacks(tmp_path):
    """tests/stacks.py's process does not find a stack module, and finds the rest."""
    code = ("import importlib.util as u, json, sys; "
            "print(json.dumps({m: u.find_spec(m) is not None for m in sys.argv[1:]}))")
    names = [*STACKS, "torch", "transformers", "ray", "gymnasium"]
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                          timeout=120, env=without_stacks(tmp_path))
    found = json.loads(proc.stdout)
    assert [m for m in names if found[m]] == ["torch", "transformers", "ray", "gymnasium"]
