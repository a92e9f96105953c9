"""A checkpoint written before each env and policy had a settings class of its own (issue 47:
one flat ``env`` with every adapter's fields, options under ``env.kwargs`` and
``policy.kwargs``) predates any user: ``m2flow-eval checkpoint=`` refuses it at start-up in one
line (exit 2) naming the field that does not fit, as any other checkpoint it cannot read."""

import torch

import m2flow

# What m2flow wrote then for maniskill_pushcube_ppo_cnn (fields of the old EnvConfig and
# PolicyConfig, abridged).
OLD_CNN = """\
workload: embodied
env:
  name: ManiSkill/PushCube-v1
  num_envs: 16
  obs_mode: rgb
  visual_mesh_fraction: 0.05
  kwargs: {}
policy:
  name: cnn
  hidden_sizes: [512]
  kwargs: {critic: privileged}
algorithm:
  name: ppo
"""

# gym's Pendulum: a field of the old flat EnvConfig that GymEnvConfig lacks, no kwargs.
OLD_GYM = """\
env:
  name: gym/Pendulum-v1
  num_envs: 2
  render_backend: auto
policy:
  name: mlp
algorithm:
  name: ppo
"""


def _refused(tmp_path, capsys, config: str) -> str:
    from m2flow.cli.eval import main as evaluate

    path = tmp_path / "last.pt"
    torch.save({"workload": "embodied", "iteration": 3, "config": config,
                "learner": {"policy": {}}, "metrics": {}}, path)
    code = evaluate([f"checkpoint={path}", f"output_dir={tmp_path / 'eval'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert not (tmp_path / "eval").exists()  # nothing started, nothing written
    return err[0]


def test_an_old_checkpoint_is_refused_in_one_line_naming_the_field(tmp_path, capsys):
    line = _refused(tmp_path, capsys, OLD_CNN)
    assert line == (
        f"m2flow-eval: config error: checkpoint={tmp_path / 'last.pt'}: its config does not "
        f"fit this m2flow's ({m2flow.__version__}) settings (env.kwargs is gone: its entries "
        "are fields of env now): it was written by m2flow (unknown version); evaluate it with "
        "that m2flow."), line
    line = _refused(tmp_path, capsys, OLD_GYM)
    assert "(env.render_backend is not a field of GymEnvConfig (env gym/Pendulum-v1))" in line
