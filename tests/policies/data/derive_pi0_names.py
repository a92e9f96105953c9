"""Writes pi0_names.txt and pi05_names.txt: the tensors of openpi's PyTorch π0 / π0.5
checkpoints (``model.safetensors`` of ``examples/convert_jax_model_to_pytorch.py``), derived
from openpi's published model code, never from m2flow's.

How (not run by the tests; needs openpi's source and transformers 4.53.2, the version openpi
pins, in a scratch directory):

1. a copy of transformers 4.53.2 with openpi's ``src/openpi/models_pytorch/transformers_replace``
   copied over it (as openpi's README says), first on ``sys.path``;
2. openpi's ``PI0Pytorch`` (``pi0_pytorch.py``, ``gemma_pytorch.py``) built on ``meta`` with
   ``paligemma_variant=gemma_2b``, ``action_expert_variant=gemma_300m``, ``action_dim=32``,
   ``action_horizon=50`` (Pi0Config's defaults), ``pi05`` False / True; the Gemma variants are
   read from ``src/openpi/models/gemma.py``'s ``get_config`` (its source, executed alone, as the
   module imports jax);
3. its ``state_dict()`` less the names safetensors' ``save_model`` drops: of the names of one
   tied tensor, it keeps the alphabetically first (``safetensors.torch._remove_duplicate_names``,
   which ``save_model`` calls; on ``meta`` every tensor has storage 0, so tied tensors are
   found here by parameter identity instead of storage).

    git -C OPENPI archive HEAD src | tar -x -C /tmp/openpi_src
    pip install --target /tmp/tf453 --no-deps transformers==4.53.2 "tokenizers<0.22" \
        "huggingface-hub<1.0"
    python -s tests/policies/data/derive_pi0_names.py /tmp/openpi_src/src /tmp/tf453 \
        tests/policies/data $(git -C OPENPI rev-parse HEAD)
"""

import ast
import dataclasses
import shutil
import sys
import tempfile
import types
from pathlib import Path


def gemma_get_config(gemma_py: Path):
    """openpi's ``get_config`` and ``Config`` from gemma.py's source, without jax."""
    tree = ast.parse(gemma_py.read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
            and n.name in ("Config", "get_config")]
    for node in keep:  # lora_configs' default needs openpi.models.lora: none here
        if isinstance(node, ast.ClassDef):
            node.decorator_list = []
            node.body = [b for b in node.body if not (isinstance(b, ast.AnnAssign)
                                                      and b.target.id == "lora_configs")]
        else:
            node.returns = None
            for arg in node.args.args:
                arg.annotation = None
    module = ast.Module(body=keep, type_ignores=[])
    ns = {"dataclasses": dataclasses}
    src = "import dataclasses\n@dataclasses.dataclass\n" + ast.unparse(module).replace(
        "lora_configs=", "_lora=")
    exec(compile(src, str(gemma_py), "exec"), ns)
    return ns["get_config"]


def main(openpi_src: str, tf_site: str, out_dir: str, commit: str) -> None:
    src, site = Path(openpi_src), Path(tf_site)
    patched = Path(tempfile.mkdtemp()) / "site"
    shutil.copytree(site, patched)
    shutil.copytree(src / "openpi/models_pytorch/transformers_replace",
                    patched / "transformers", dirs_exist_ok=True)
    sys.path[:0] = [str(patched), str(src)]
    import torch

    # openpi.models and openpi.shared import jax; pi0_pytorch needs only gemma.get_config and
    # preprocessing_pytorch's import of image_tools (unused by the constructor)
    import openpi
    models = types.ModuleType("openpi.models")
    models.gemma = types.ModuleType("openpi.models.gemma")
    models.gemma.get_config = gemma_get_config(src / "openpi/models/gemma.py")
    shared = types.ModuleType("openpi.shared")
    shared.image_tools = types.ModuleType("openpi.shared.image_tools")
    for mod in (models, models.gemma, shared, shared.image_tools):
        sys.modules[mod.__name__] = mod
    openpi.models, openpi.shared = models, shared
    from openpi.models_pytorch import pi0_pytorch

    for pi05, name in ((False, "pi0_names.txt"), (True, "pi05_names.txt")):
        cfg = types.SimpleNamespace(pi05=pi05, paligemma_variant="gemma_2b",
                                    action_expert_variant="gemma_300m", action_dim=32,
                                    action_horizon=50, dtype="bfloat16",
                                    pytorch_compile_mode=None)
        with torch.device("meta"):
            model = pi0_pytorch.PI0Pytorch(cfg)
        state = model.state_dict()
        tied = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(n)
        dropped = {n for names in tied.values() for n in sorted(names)[1:]}
        lines = [f"{k} {','.join(map(str, v.shape))}" for k, v in state.items()
                 if k not in dropped]
        head = [f"# openpi's PyTorch {'π0.5' if pi05 else 'π0'} checkpoint tensors: name, shape",
                f"# derived from Physical-Intelligence/openpi {commit} (src/openpi/"
                "models_pytorch/) by tests/policies/data/derive_pi0_names.py, with",
                "# transformers 4.53.2 + openpi's transformers_replace; not from m2flow's code"]
        (Path(out_dir) / name).write_text("\n".join(head + lines) + "\n")
        print(name, len(lines), "tensors;", "dropped as tied:", sorted(dropped))


if __name__ == "__main__":
    main(*sys.argv[1:5])
