"""The one evaluation loop (``eval_protocol.evaluate``) of training and ``m2flow-eval``: its
per-task tally, its metrics and its curtailing, against hand-worked outcomes of a stub round."""

import math

import pytest

from m2flow.embodied.eval_protocol import evaluate
from m2flow.embodied.workers.episodes import EpisodeStats, EvalEpisode
from m2flow.pipelines.futures import Stopped
from m2flow.runs import seeding
from m2flow.runs.logger import Progress

TASKS = ["push it", "pull it", "lift it"]
# (task, episode) -> (success_once, success_at_end, discarded); a multi-task episode e starts
# from seed e. Task 0: 2/2 once, 1/2 at end; task 1: 0/1 (its episode 1 lost to a restart);
# task 2: 2/2 both.
OUTCOMES = {(0, 0): (True, True, False), (0, 1): (True, False, False),
            (1, 0): (False, False, False), (1, 1): (True, True, True),
            (2, 0): (True, True, False), (2, 1): (True, True, False)}


class StubRounds:
    """``EmbodiedRunner.eval_round`` with known outcomes: return 10 * task + seed + 1, length
    5 + task; a filler (task 0, seed 0) succeeds as episode (0, 0) does."""

    def __init__(self):
        self.calls = []

    def __call__(self, per_rank, deterministic=True):
        self.calls.append(per_rank)
        return [[EvalEpisode(seed=s, task=t, ret=10.0 * t + s + 1, length=5 + t,
                             success_once=o, success_at_end=e, discarded=d)
                 for s, t in zip(r.seeds, r.tasks)
                 for o, e, d in [OUTCOMES[(t, s)]]] for r in per_rank]


def test_three_tasks_of_two_episodes_on_four_slots():
    """2 env workers x 2 envs: round 1 runs tasks 0 and 1, round 2 task 2 and two fillers."""
    rounds, lines = StubRounds(), []
    ev = evaluate(rounds, TASKS, 2, ranks=2, envs_per_rank=2, seed=0, multi_task=True,
                  progress=Progress("eval suite", 6, write=lines.append, every_s=0))
    assert [[(r.tasks, r.seeds) for r in c] for c in rounds.calls] == [
        [([0, 0], [0, 1]), ([1, 1], [0, 1])], [([2, 2], [0, 1]), ([0, 0], [0, 0])]]
    assert [(t.episodes, t.successes_once, t.successes_at_end, t.discarded)
            for t in ev.tasks] == [(2, 2, 1, 0), (1, 0, 0, 1), (2, 2, 2, 0)]
    # after round 1, pooled over its 3 counted episodes: once 2/3, at end 1/3
    assert lines[0].startswith("eval suite: 4/6 ep | success 0.67/0.33 | task 2/3 pull it |")
    assert ev.metrics() == pytest.approx({
        "eval/discarded_episodes": 1.0, "eval/episodes": 5.0,
        "eval/return": (1 + 2 + 11 + 21 + 22) / 5, "eval/episode_len": (5 + 5 + 6 + 7 + 7) / 5,
        "eval/success_once": (1 + 0 + 1) / 3, "eval/success_at_end": (0.5 + 0 + 1) / 3,
        "eval/task0/success_once": 1.0, "eval/task0/success_at_end": 0.5,
        "eval/task1/success_once": 0.0, "eval/task1/success_at_end": 0.0,
        "eval/task2/success_once": 1.0, "eval/task2/success_at_end": 1.0})
    assert [(e["task"], e["episode"]) for e in ev.per_episode] == sorted(OUTCOMES)


@pytest.mark.parametrize("reach,metric,calls", [
    # one env: a round per task. After round 1 (task 0: 2/2 once) at best (1 + 1 + 1) / 3;
    # after round 2 (task 1: 0/1) at best (1 + 0 + 1) / 3 = 0.667
    (0.6, "success_once", 3), (0.7, "success_once", 2),
    # at end, after round 1 (task 0: 1/2) at best (0.5 + 1 + 1) / 3 = 0.833
    (0.8, "success_at_end", 2), (0.9, "success_at_end", 1)])
def test_curtailed_after_the_first_round_the_mean_cannot_reach(reach, metric, calls):
    rounds = StubRounds()
    ev = evaluate(rounds, TASKS, 2, ranks=1, envs_per_rank=2, seed=0, multi_task=True,
                  reach=reach, metric=metric)
    assert len(rounds.calls) == calls
    assert ev.curtailed == (calls < 3)
    assert ev.metrics(curtail=True)["eval/curtailed"] == float(calls < 3)
    assert ev.episodes + ev.discarded == 2 * calls


def test_one_task_metrics_are_training_episode_stats():
    """A one-task env's metrics are those ``EpisodeStats.summary`` gives the same counted
    episodes (training's tally of ``env/*``), with no per-task keys; 5 episodes on 4 slots,
    the fillers (which all succeed) counted nowhere."""
    outcomes = [(True, False, False), (False, False, True), (True, True, False),
                (False, False, False), (True, True, False)] + [(True, True, False)] * 3
    seeds = seeding.eval_seeds(3, 8)  # episode k's seed; 5 to 7: the fillers'

    def one_task(per_rank, deterministic=True):
        assert all(r.tasks is None for r in per_rank)
        return [[EvalEpisode(seed=s, ret=0.5 * k, length=k + 1, success_once=o,
                             success_at_end=e, discarded=d)
                 for s in r.seeds for k in [seeds.index(s)] for o, e, d in [outcomes[k]]]
                for r in per_rank]

    ev = evaluate(one_task, ["gym/Pendulum-v1"], 5, ranks=2, envs_per_rank=2, seed=3,
                  multi_task=False)
    kept = [k for k in range(5) if not outcomes[k][2]]
    stats = EpisodeStats([0.5 * k for k in kept], [k + 1 for k in kept],
                         [outcomes[k][0] for k in kept], [outcomes[k][1] for k in kept],
                         discarded=1)
    assert ev.metrics() == pytest.approx(
        {k.replace("env/", "eval/"): v for k, v in stats.summary().items()})


def test_a_stop_keeps_the_rounds_before_it_only_when_asked():
    rounds = StubRounds()

    def stop_in_round_2(per_rank, deterministic=True):
        if len(rounds.calls) == 1:
            raise Stopped(["env.eval_round_ranks()"])
        return rounds(per_rank)

    ev = evaluate(stop_in_round_2, TASKS, 2, ranks=1, envs_per_rank=2, seed=0,
                  multi_task=True, keep_on_stop=True)
    assert ev.interrupted and (ev.episodes, ev.asked) == (2, 6)
    rounds.calls = []
    with pytest.raises(Stopped):
        evaluate(stop_in_round_2, TASKS, 2, ranks=1, envs_per_rank=2, seed=0, multi_task=True)


def test_a_failure_keeps_the_rounds_before_it_only_when_asked():
    """A worker that died in round 2 (of 3): with ``keep_on_failure`` the loop ends with round
    1's two episodes (task 0's, as ``OUTCOMES`` says) and the error; without it, it raises."""
    rounds = StubRounds()
    died = RuntimeError("worker env[rank 0] in eval_round(): its process died.")

    def die_in_round_2(per_rank, deterministic=True):
        if len(rounds.calls) == 1:
            raise died
        return rounds(per_rank)

    ev = evaluate(die_in_round_2, TASKS, 2, ranks=1, envs_per_rank=2, seed=0,
                  multi_task=True, keep_on_failure=True)
    assert ev.failure is died and not ev.interrupted
    assert (ev.episodes, ev.asked) == (2, 6)
    assert [(e["task"], e["episode"], e["success_at_end"]) for e in ev.per_episode] == [
        (0, 0, True), (0, 1, False)]
    rounds.calls = []
    with pytest.raises(RuntimeError, match="its process died"):
        evaluate(die_in_round_2, TASKS, 2, ranks=1, envs_per_rank=2, seed=0, multi_task=True,
                 keep_on_stop=True)


class SeededRounds:
    """A round whose episodes end by their seed alone, as a deterministic policy's do:
    success_once unless the seed is divisible by 3, success_at_end when it is even."""

    def __init__(self):
        self.calls = []

    def __call__(self, per_rank, deterministic=True):
        self.calls.append([list(r.seeds) for r in per_rank])
        tasks = [r.tasks or [0] * len(r.seeds) for r in per_rank]
        return [[EvalEpisode(seed=s, task=t, ret=float(s % 7), length=5, success_once=s % 3 != 0,
                             success_at_end=s % 2 == 0, discarded=False)
                 for s, t in zip(r.seeds, ts)] for r, ts in zip(per_rank, tasks)]


@pytest.mark.parametrize("small,multi_task", [(8, False), (6, False), (2, True)])
def test_a_larger_evaluation_reuses_the_episodes_it_starts_with(small, multi_task):
    """``known`` (runner.stop_confirm_episodes): 20 episodes (per task, 3 tasks, when
    multi-task) after ``small`` of the same weights give the metrics 20 run afresh give,
    with no round re-run whose episodes all ended already (one-task on 4 slots: the 8's two
    rounds; the 6's first round, its second holding episodes 6 and 7 too)."""
    names = TASKS if multi_task else ["PushCube-v1"]
    kw = dict(ranks=2, envs_per_rank=2, seed=5, multi_task=multi_task)
    fresh = evaluate(SeededRounds(), names, 20, **kw)
    first = evaluate(SeededRounds(), names, small, **kw)
    rounds = SeededRounds()
    again = evaluate(rounds, names, 20, known=first, **kw)
    assert again.metrics() == fresh.metrics()
    assert again.per_episode == fresh.per_episode
    full = math.ceil(20 * len(names) / 4)
    skipped = {(8, False): 2, (6, False): 1, (2, True): 0}[(small, multi_task)]
    assert len(rounds.calls) == full - skipped
    if not multi_task:  # the rounds run are the last ones of the fresh evaluation
        assert rounds.calls[0] == [seeding.eval_seeds(5, 20)[4 * skipped:][:2],
                                   seeding.eval_seeds(5, 20)[4 * skipped + 2:][:2]]


def test_a_known_evaluation_counts_as_it_ended_and_needs_mean_actions():
    """An episode ``known`` counted keeps its outcome though a re-run round ends it otherwise
    (the reported 64 stay the 256's first 64), and sampled actions refuse ``known``."""
    names = ["PushCube-v1"]
    kw = dict(ranks=1, envs_per_rank=4, seed=0, multi_task=False)
    first = evaluate(SeededRounds(), names, 2, **kw)  # round 1 also ran seeds 2-3 as fillers
    flipped = {k: EvalEpisode(seed=e.seed, task=e.task, ret=e.ret, length=e.length,
                              success_once=not e.success_once, success_at_end=e.success_at_end,
                              discarded=False) for k, e in first.results.items()}
    first.results = flipped
    again = evaluate(SeededRounds(), names, 4, known=first, **kw)  # round 1 re-runs (2 new)
    assert [e["success_once"] for e in again.per_episode[:2]] == [
        not (s % 3 != 0) for s in seeding.eval_seeds(0, 4)[:2]]
    with pytest.raises(ValueError, match="sampled actions"):
        evaluate(SeededRounds(), names, 4, known=first, deterministic=False, **kw)
