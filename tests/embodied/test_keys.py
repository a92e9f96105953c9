"""``m2flow.keys`` lists every key that crosses a layer: a key a real env step, a policy, the
env and rollout workers or the reasoning engine write that has no constant there fails here."""

import threading

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.workers.env_worker import EnvWorker
from m2flow.embodied.workers.rollout_worker import RolloutWorker
from m2flow.envs import env_config, make_env
from m2flow.envs.chunked import ChunkedEnv
from m2flow.pipelines import (
    Channel,
    Cluster,
    ClusterConfig,
    RankResources,
    Worker,
    WorkerGroup,
    WorkerInfo,
)
from m2flow.policies import make_policy, policy_config

PENDULUM = env_config(name="gym/Pendulum-v1", num_envs=2)
K = 3  # env steps of an action chunk


def unknown(td: TensorDict) -> set:
    """Leaf keys of ``td`` without a constant; observations count under ``keys.OBS``'s names
    wherever they sit (root obs, next obs)."""
    known = keys.all_keys()
    out = set()
    for key in td.keys(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        if key[: len(keys.NEXT_OBS)] == keys.NEXT_OBS:
            key = (keys.OBS, *key[len(keys.NEXT_OBS) :])
        if (key[0] if len(key) == 1 else key) not in known:
            out.add(key)
    return out


def test_the_table_documents_every_constant():
    doc = keys.__doc__
    for key in keys.all_keys():
        shown = f'"{key}"' if isinstance(key, str) else "(" + ", ".join(f'"{k}"' for k in key) + ")"
        assert shown in doc, f"{shown} has a constant but no row in m2flow.keys' table"


def test_a_real_env_step_and_chunk_write_only_listed_keys():
    env = ChunkedEnv(make_env(PENDULUM))
    try:
        first = env.reset(seed=[0, 1])
        assert unknown(first) == set()
        step = env.step(torch.zeros(2, env.spec.action_dim))
        assert unknown(step) == set()
        chunk = env.step(torch.zeros(2, K, env.spec.action_dim))
        assert keys.NUM_STEPS in chunk.keys(include_nested=True)
        assert unknown(chunk) == set()
        env.frames_key = keys.leaf(keys.STATE)  # any obs key: every step's value, as video frames
        with_frames = env.step(torch.zeros(2, K, env.spec.action_dim))
        assert with_frames[keys.FRAMES].shape[:2] == (2, K)
        assert unknown(with_frames) == set()
    finally:
        env.close()


def test_a_policys_act_and_evaluate_actions_write_only_listed_keys():
    env = make_env(PENDULUM)
    try:
        batch = env.reset(seed=[0, 1])
        torch.manual_seed(0)
        policy = make_policy(policy_config(name="mlp", hidden_sizes=[8]), env.spec)
        out = policy.act(batch)
        assert unknown(out) == set()
        batch.update(out)
        assert unknown(policy.evaluate_actions(batch)) == set()
    finally:
        env.close()


def test_a_token_policy_writes_only_listed_keys():
    from tests.policies.test_vla import obs, policy

    pi = policy()
    batch = TensorDict({keys.OBS: obs()}, batch_size=[3])
    out = pi.act(batch)
    assert {keys.ACTION_TOKENS, keys.TOKEN_LOG_PROB} <= set(out.keys())
    assert unknown(out) == set()
    batch.update(out)
    assert unknown(pi.evaluate_actions(batch)) == set()


def test_a_collected_trajectory_has_only_listed_keys():
    """An env worker and a rollout worker in this process, through real channels."""
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    sink = WorkerGroup(cluster, "sink", Worker, [RankResources(0, 1.0, ())])
    obs_ch, act_ch, traj_ch = (Channel(n, sink, item_type=TensorDict)
                               for n in ("obs", "action", "trajectory"))
    info = lambda role: WorkerInfo(role, 0, 1, RankResources(0, 1.0, ()), "local")  # noqa: E731
    env = EnvWorker(info("env"), PENDULUM, seed=0, channel_timeout=60)
    rollout = RolloutWorker(info("rollout"), policy_config(name="mlp", hidden_sizes=[8]),
                            env.spec(), seed=0, channel_timeout=60)
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(stats=env.collect(
            obs_ch, act_ch, traj_ch, num_steps=4, iteration=0)), daemon=True)
        thread.start()
        rollout.serve(obs_ch, act_ch, stage_keys=[(0, 0)], num_steps=4, iteration=0)
        thread.join(timeout=60)
        assert "stats" in result, "the env worker did not finish"
        traj = traj_ch.get(key=0, timeout=10)
        assert traj.batch_size == (2, 4)
        assert {keys.VALID, keys.POLICY_VERSION} <= set(traj.keys())
        assert unknown(traj) == set()
    finally:
        env.close()
        sink.shutdown()


def test_the_reasoning_engine_writes_only_listed_keys():
    from m2flow.reasoning.config import GenerationConfig, ModelConfig
    from m2flow.reasoning.engine import HFEngine
    from m2flow.reasoning.model import load_model

    cfg = ModelConfig()
    cfg.tiny.num_hidden_layers = 1
    torch.manual_seed(0)
    model, tok = load_model(cfg)
    engine = HFEngine(model, tok, GenerationConfig(max_new_tokens=3), "cpu")
    out = engine.generate(["Q: 1+1?\nA:"], 2, seed=0)
    assert set(out.keys()) == {keys.PROMPT_IDS, keys.PROMPT_MASK, keys.COMPLETION_IDS,
                               keys.COMPLETION_MASK, keys.LOGPROBS}
