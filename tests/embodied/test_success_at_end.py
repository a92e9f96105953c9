"""``success_once`` and ``success_at_end`` of hand-made episodes, through the code that counts
them: ``RunningEpisodes`` (training), ``EvalRecorder`` (evaluation), and action chunks
(``chunked.combine``) on their way into both."""

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.workers.env_eval import EvalRecorder
from m2flow.embodied.workers.episodes import RunningEpisodes
from m2flow.embodied.eval_protocol import can_reach
from m2flow.embodied.runner import SuccessStop
from m2flow.envs.chunked import combine

F, T = False, True
# per env, 4 steps, the episode ends at the last: env 0 reaches the goal and leaves it,
# env 1 reaches it only at the end, env 2 never does
FLAGS = [[F, T, T, F], [F, F, F, T], [F, F, F, F]]
ONCE, AT_END = [T, T, F], [F, T, F]


def step(success, done, discarded=None) -> TensorDict:
    n = len(success)
    out = {keys.REWARD: torch.ones(n), keys.SUCCESS: torch.tensor(success),
           keys.DONE: torch.tensor(done)}
    if discarded is not None:
        out[keys.DISCARDED] = torch.tensor(discarded)
    return TensorDict(out, batch_size=[n])


def episode_steps(flags=FLAGS) -> list[TensorDict]:
    k = len(flags[0])
    return [step([f[t] for f in flags], [t == k - 1] * len(flags)) for t in range(k)]


def test_training_episodes_count_success_once_and_at_end():
    runs = RunningEpisodes(3)
    ended = [runs.update(s) for s in episode_steps()]
    assert [e.returns for e in ended[:3]] == [[], [], []]
    assert ended[3].success_once == ONCE and ended[3].success_at_end == AT_END
    summary = ended[3].summary()
    assert summary["env/success_once"] == 2 / 3 and summary["env/success_at_end"] == 1 / 3
    # the next episodes start from nothing: a failure by both counts unless they succeed
    again = [runs.update(s) for s in episode_steps([[F, F, F, F], [T, F, F, F], [F, F, T, T]])]
    assert again[3].success_once == [F, T, T] and again[3].success_at_end == [F, F, T]


def test_a_lost_episode_counts_in_neither():
    runs = RunningEpisodes(2)
    runs.update(step([T, T], [F, F]))
    lost = runs.update(step([T, T], [T, T], discarded=[T, F]))
    assert lost.success_once == [T] and lost.success_at_end == [T] and lost.discarded == 1


def test_evaluation_keeps_each_envs_first_episode_with_both_figures():
    rec = EvalRecorder([2, 2], {"state": (3,)}, seeds=[10, 11, 12, 13])
    # env 3 holds the goal throughout but never ends; the next episodes of envs 0-2 succeed
    for s in [*episode_steps([*FLAGS, [T] * 4]), *episode_steps([[T] * 4] * 4)]:
        s[keys.DONE][3] = False
        rec.record(0, s[:2])
        rec.record(1, s[2:])
    eps = rec.finish()
    assert [e.success_once for e in eps] == [*ONCE, F]  # env 3 still running: a failure
    assert [e.success_at_end for e in eps] == [*AT_END, F]
    assert [e.length for e in eps] == [4, 4, 4, 8]


def test_a_chunk_reports_the_flag_of_the_episodes_last_step():
    # K = 4 steps of 3 envs. env 0's episode ends at step 2 with flags T, T, F (reached, then
    # left); its next episode's step 3 succeeds, which must not leak into this transition.
    # env 1 ends at step 3 with F, F, F, T. env 2 runs on: T at step 1, F at step 3.
    success = [[T, T, F, T], [F, F, F, T], [F, T, F, F]]
    done = [[F, F, T, F], [F, F, F, T], [F, F, F, F]]
    outs = []
    for t in range(4):
        s = step([f[t] for f in success], [d[t] for d in done])
        s[keys.TERMINATED] = s[keys.TRUNCATED] = torch.zeros(3, dtype=torch.bool)
        s[keys.NEXT_OBS] = TensorDict({"state": torch.zeros(3, 1)}, batch_size=[3])
        s[keys.OBS] = s[keys.NEXT_OBS].clone()
        outs.append(s)
    out = combine(outs)
    assert out[keys.SUCCESS].tolist() == [T, T, T]  # at any step of the episode's part
    assert out[keys.SUCCESS_AT_END].tolist() == [F, T, F]
    runs = RunningEpisodes(3)
    ended = runs.update(out)
    assert ended.success_once == [T, T] and ended.success_at_end == [F, T]
    rec = EvalRecorder([3], {"state": (1,)}, seeds=[0, 1, 2])
    rec.record(0, out)
    eps = rec.finish()
    assert [(e.success_once, e.success_at_end) for e in eps] == [(T, F), (T, T), (F, F)]


def test_the_stop_rule_and_the_curtailed_evaluation_use_the_figure_they_are_given():
    # 4 episodes of hand-made flags: success_once 3/4, success_at_end 1/4
    once, at_end = [T, T, T, F], [F, T, F, F]
    rule = SuccessStop(0.75, metric="success_at_end")
    assert not rule.update(sum(at_end) / 4) and rule.update(0.75)
    assert rule.describe(0.75).startswith("eval/success_at_end 0.750 >= runner.stop_at_success")
    # 12 more episodes to come, target 0.9 of 16 (14.4): 3 + 12 can reach it, 1 + 12 cannot
    assert can_reach(once, 12, 0.9) and not can_reach(at_end, 12, 0.9)
