"""RL from a behaviour-cloning checkpoint (``init_from``): the recipe of issue 15 in small.

The demonstrations are ManiSkill's motion-planning solutions for exactly the initial states
GRPO's first iteration resets its two groups to. An MLP cloned from two demonstrations replays
them when it acts deterministically, but it is fragile off their path: sampled with the std
of ``policy.init_log_std=-5`` (which BC with the ``mse`` loss leaves as it is) it succeeds in
some of those episodes and not in others (measured: 2/6 and 5/6 of the two initial states;
at -4 0/6 and 5/6, at -3 0/6 and 1/6), so the groups have something to learn from.
"""

import pytest
import torch
from tensordict import TensorDict

from m2flow.cli.common import load_run_config
from m2flow.configs import ConfigError
from m2flow.embodied.demos import maniskill as demos_mod
from m2flow.embodied.workers.resets import env_seeds
from m2flow.embodied.workers.rollout_worker import RolloutWorker
from m2flow.embodied.runner import EmbodiedRunner
from m2flow.policies import make_policy
from m2flow.runs import checkpoint, seeding

ENVS, GROUP, SEED = 8, 4, 0
COMMON = ["cluster=inprocess", f"env.num_envs={ENVS}", "runner.eval_interval=0",
          "runner.progress_bar=false", "policy.hidden_sizes=[64,64]", f"seed={SEED}",
          "env.max_episode_steps=100", "policy.init_log_std=-5.0",  # the demos' limit: the planner needs 55-80 steps
          "env.control_mode=pd_ee_delta_pos"]  # the planner's (env/maniskill_pushcube), not the default job's joints


def expert_dataset(path):
    """One planner demonstration (state obs) per initial state of GRPO's first iteration, as a
    (N, T) TensorDict with ``valid`` marking each episode's steps."""
    seeds = env_seeds(SEED, seeding.TRAIN, iteration=0, rank=0, num_envs=ENVS,
                      group_size=GROUP)[::GROUP]
    kept = []
    for s in seeds:
        cfg = demos_mod.load_demos_config(overrides=[
            "env=maniskill_pushcube", "env.obs_mode=state", f"demos.seed={s}",
            "demos.episodes=1", "demos.max_tries=1", f"demos.output={path}.{s}"])
        demos, _, _ = demos_mod.generate(cfg, log=lambda line: None)
        assert len(demos) == 1, f"the planner failed for seed {s}"
        kept += demos
    t = max(len(d.actions) for d in kept)
    state = torch.zeros(len(kept), t, kept[0].obs["state"].shape[-1])
    action = torch.zeros(len(kept), t, kept[0].actions.shape[-1])
    valid = torch.zeros(len(kept), t, dtype=torch.bool)
    for i, d in enumerate(kept):
        n = len(d.actions)
        state[i, :n] = torch.from_numpy(d.obs["state"][:n])
        action[i, :n] = torch.from_numpy(d.actions)
        valid[i, :n] = True
    torch.save(TensorDict({"obs": {"state": state}, "action": action, "valid": valid},
                          batch_size=[len(kept), t]), path)


def train(tmp_path, name, *extra):
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        *COMMON, f"runner.log_dir={tmp_path}", f"run_name={name}", *extra])
    runner = EmbodiedRunner(cfg)
    try:
        runner.train()
        return runner.run_dir / "checkpoints" / "last.pt"
    finally:
        runner.close()


@pytest.fixture(scope="module")
def bc_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    expert_dataset(tmp / "expert.pt")
    return train(tmp, "bc", "algorithm=bc", f"algorithm.dataset={tmp / 'expert.pt'}",
                 "algorithm.loss=mse", "algorithm.batch_size=64", "algorithm.learning_rate=3e-3",
                 "runner.rollout_steps=1", "runner.num_iterations=300",
                 "runner.checkpoint_interval=0")


def test_grpo_from_a_bc_checkpoint_starts_from_its_weights_and_learns(tmp_path, bc_checkpoint):
    ckpt = train(tmp_path, "grpo", "algorithm=grpo", f"algorithm.group_size={GROUP}",
                 f"init_from={bc_checkpoint.parent.parent}", "runner.num_iterations=1",
                 "runner.rollout_steps=100", "algorithm.learning_rate=1e-5")
    bc = checkpoint.load(bc_checkpoint)["learner"]["policy"]
    rl = checkpoint.load(ckpt)
    m = rl["metrics"]
    # some episodes of the cloned policy succeed and some fail: groups are kept, loss non-zero
    assert 0 < m["grpo/episode_success_once"] < 1 and m["grpo/groups_kept"] > 0, m
    assert m["loss/loss_policy"] != 0 and rl["iteration"] == 1
    # one small step from the BC weights, not from fresh ones (the observation statistics,
    # buffers, move with the new iteration's observations)
    diff = max(float((rl["learner"]["policy"][k] - w).abs().max()) for k, w in bc.items()
               if not k.startswith("obs_norm"))
    assert 0 < diff < 1e-2, diff
    assert len(rl["learner"]["optimizer"]["state"]) > 0  # Adam's own, after one update


def test_init_from_another_policy_or_an_unknown_skipped_tensor_is_one_config_error(tmp_path, bc_checkpoint):
    with pytest.raises(ConfigError) as e:
        load_run_config("maniskill_pushcube_ppo_cnn", [f"init_from={bc_checkpoint}"])
    text = str(e.value)
    assert "init_from=" in text and "policy=mlp" in text and "policy=cnn" in text, text
    assert "\n" not in text
    with pytest.raises(ConfigError) as e:
        load_run_config("maniskill_pushcube_ppo_mlp", [f"init_from={bc_checkpoint}",
                                                        "init_skip=[actor_logstd]"])
    text = str(e.value)
    assert "init_skip=" in text and "did you mean actor_log_std" in text, text
    assert "\n" not in text


def test_held_state_statistics_without_a_checkpoint_to_hold_are_one_config_error():
    with pytest.raises(ConfigError) as e:
        load_run_config("maniskill_pickcube_ppo_mlp_from_bc", ["policy.hold_obs_norm=true"])
    text = str(e.value)
    assert "policy.hold_obs_norm=" in text and "init_from=" in text and "\n" not in text, text


def deterministic_actions(cfg, spec, weights, states):
    """The mean actions of ``cfg.policy`` with ``weights`` on ``states`` (a policy built apart
    from the run's workers)."""
    pi = make_policy(cfg.policy, spec)
    pi.load_state_dict(weights)
    batch = TensorDict({"obs": {"state": states}}, batch_size=[states.shape[0]])
    with torch.no_grad():
        return pi.act(batch, deterministic=True)["action"]


def test_ppo_from_a_bc_checkpoint_acts_as_it_and_its_critic_warmup_leaves_the_actor(
        tmp_path, bc_checkpoint):
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        *COMMON, f"runner.log_dir={tmp_path}", "run_name=ppo", f"init_from={bc_checkpoint}",
        "algorithm.critic_warmup=2", "runner.num_iterations=2", "runner.rollout_steps=20",
        # the exploration noise from this config, not from the checkpoint (BC's: -5)
        "init_skip=[actor_log_std]", "policy.init_log_std=-2.0"])
    runner = EmbodiedRunner(cfg)
    try:
        served = runner.rollout.call(RolloutWorker.get_weights).wait()[0]  # after the first sync
        runner.train()
        warmed = runner.rollout.call(RolloutWorker.get_weights).wait()[0]
        spec = runner.spec
    finally:
        runner.close()
    bc = checkpoint.load(bc_checkpoint)["learner"]["policy"]  # the file the BC run wrote
    states = torch.randn(64, spec.obs_shapes["state"][0], generator=torch.Generator().manual_seed(0))
    want = deterministic_actions(cfg, spec, bc, states)
    assert want.abs().max() > 0.05  # a trained actor, not zeros
    assert torch.equal(deterministic_actions(cfg, spec, served, states), want)
    assert torch.equal(bc["actor_log_std"], torch.full_like(bc["actor_log_std"], -5.0))
    assert torch.equal(served["actor_log_std"], torch.full_like(bc["actor_log_std"], -2.0))
    # two iterations of the critic alone: the actor bit for bit BC's, its observation
    # statistics too (they are the actor's input); the critic moved
    assert torch.equal(deterministic_actions(cfg, spec, warmed, states), want)
    actor = [k for k in bc if not k.startswith("critic")]
    assert all(torch.equal(warmed[k], bc[k] if k != "actor_log_std" else served[k])
               for k in actor), actor
    assert any(not torch.equal(warmed[k], served[k]) for k in warmed if k.startswith("critic"))
