"""``m2flow-eval``'s protocol: N episodes per task, envs in parallel, a report of each.

Episode e of task j runs on some env slot (env worker rank, env index) in some round; every
slot runs one counted episode per round (its first), so a round of M env workers with n envs
each evaluates M*n episodes at once. Seeds: a multi-task env (``spec.tasks``, e.g. LIBERO)
starts episode e from seed e, which LIBERO maps to the task's init state e (the LIBERO
protocol); a one-task env starts episode e from ``seeding.eval_seeds(seed, .)[e]``, as
training-time evaluation does. No episode's seed depends on the layout, so one checkpoint
gives the same episodes with any ``env.num_envs`` or number of env workers.

``run_protocol`` returns the report (per task and mean, and ``per_episode``: each episode's
task, index, seed and outcome, the same whatever the layout), which ``eval_report`` writes
out (``results.json``, ``results.md``, the videos of each task's first episodes).

Each figure comes twice, as ManiSkill's evaluation reports it: ``success_once`` (the goal
held at some step of the episode) and ``success_at_end`` (at its last step); an episode
still running when its round ends fails by both.

A first Ctrl-C or SIGTERM (``runs.control.RunControl``) abandons the round in flight; the
report then holds the rounds completed before it, says so (``interrupted``) and is written as
a partial report, so an evaluation of hours stopped near its end keeps what it measured.
A failure (a worker that died, one killed for memory) keeps them the same way, and the
failure's line says where (``runs.failure.EvalFailed``).

``evaluate`` is the loop itself, and training's evaluation (``EmbodiedRunner.run_eval``) runs
it too: the same layout, seeds and per-task tally (``Evaluation``), its ``eval/*`` metrics
from ``Evaluation.metrics``, and, with ``reach``, an end after the first round from which the
success rate can no longer reach it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from m2flow.pipelines.errors import failure_cause
from m2flow.pipelines.futures import Stopped
from m2flow.runs import seeding
from m2flow.embodied.workers.env_eval import EvalRound
from m2flow.embodied.workers.episodes import EvalEpisode

MULTI_TASK_EPISODES = 50  # the LIBERO protocol: 50 episodes per task


@dataclass
class Slot:
    """What one env runs in a round: episode ``episode`` of ``task`` (None: a filler, not
    counted, since the round has more envs than episodes left)."""

    task: int
    episode: Optional[int]
    seed: int
    video: bool = False


@dataclass
class TaskResult:
    """One task's tally: its counted episodes' successes, returns and lengths, and the
    episodes lost to simulator restarts (``discarded``, counted nowhere else)."""

    task: int
    name: str
    asked: int = 0
    """Episodes the layout gives this task (counted, discarded or not run yet)."""
    episodes: int = 0
    successes_once: int = 0
    successes_at_end: int = 0
    discarded: int = 0
    returns: list = field(default_factory=list)
    lengths: list = field(default_factory=list)

    def rate(self, successes: int) -> float:
        return successes / self.episodes if self.episodes else float("nan")

    def successes(self, metric: str) -> int:
        """Successes by ``metric``: 'success_once' or 'success_at_end'."""
        return {"success_once": self.successes_once, "success_at_end": self.successes_at_end}[metric]

    def left(self) -> int:
        """Episodes of this task not run yet."""
        return self.asked - self.episodes - self.discarded

    def add(self, ep: EvalEpisode) -> None:
        if ep.discarded:
            self.discarded += 1  # lost to a simulator restart: not counted
            return
        self.episodes += 1
        self.successes_once += ep.success_once
        self.successes_at_end += ep.success_at_end
        self.returns.append(ep.ret)
        self.lengths.append(ep.length)

    def row(self) -> dict:
        n = max(1, self.episodes)
        return {
            "task": self.task, "name": self.name, "episodes": self.episodes,
            "successes_once": self.successes_once, "successes_at_end": self.successes_at_end,
            "success_once": self.rate(self.successes_once),
            "success_at_end": self.rate(self.successes_at_end),
            "mean_return": sum(self.returns) / n, "mean_length": sum(self.lengths) / n,
            "discarded": self.discarded,
        }


def episode_rounds(num_tasks: int, per_task: int, ranks: int, envs_per_rank: int,
                   base_seed: int, videos_per_task: int,
                   one_task_env: bool = False, first: int = 0) -> list[list[list[Slot]]]:
    """Rounds -> env worker ranks -> slots. Episodes are laid out task by task. Episode e
    starts from seed ``first + e``, or, for a one-task env, from
    ``seeding.eval_seeds(base_seed, .)[first + e]`` (training-time evaluation's seeds, which
    start at ``first`` 0): either way an episode's seed never depends on the layout
    (``env.num_envs``, env workers). ``first`` skips the initial states a first evaluation
    (or the demonstrations) used: LIBERO's episode e of a task then starts from init state
    ``first + e``.

    >>> rounds = episode_rounds(num_tasks=3, per_task=2, ranks=1, envs_per_rank=4, base_seed=0,
    ...                         videos_per_task=1)
    >>> [[(s.task, s.episode, s.video) for s in r[0]] for r in rounds]
    [[(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False)], [(2, 0, True), (2, 1, False), (0, None, False), (0, None, False)]]
    >>> later = episode_rounds(num_tasks=2, per_task=2, ranks=1, envs_per_rank=4, base_seed=0,
    ...                        videos_per_task=0, first=10)
    >>> [(s.task, s.episode, s.seed) for s in later[0][0]]
    [(0, 0, 10), (0, 1, 11), (1, 0, 10), (1, 1, 11)]
    """
    episodes = [(j, e) for j in range(num_tasks) for e in range(per_task)]
    slots = ranks * envs_per_rank
    num_rounds = math.ceil(len(episodes) / slots)
    # one-task: a filler in slot k (past the last episode) runs the seed of episode k, never
    # one a counted episode has; multi-task: seed ``first`` (task 0's first init state)
    seeds = (seeding.eval_seeds(base_seed, first + num_rounds * slots)[first:]
             if one_task_env else None)
    rounds = []
    for r in range(num_rounds):
        per_rank = []
        for rank in range(ranks):
            row = []
            for i in range(envs_per_rank):
                k = r * slots + rank * envs_per_rank + i
                if k < len(episodes):
                    j, e = episodes[k]
                    row.append(Slot(j, e, first + e if seeds is None else seeds[k],
                                    e < videos_per_task))
                else:
                    row.append(Slot(0, None, first if seeds is None else seeds[k]))
            per_rank.append(row)
        rounds.append(per_rank)
    return rounds


def episodes_per_task(episodes: int, num_tasks: int) -> int:
    """Training's evaluation of ``episodes`` over ``num_tasks`` tasks (0: a one-task env): the
    same number for every task, rounded down when it does not divide (so an evaluation never
    runs more than asked), but at least one per task (then it runs ``num_tasks``).

    >>> episodes_per_task(64, 10), episodes_per_task(4, 10), episodes_per_task(16, 0)
    (6, 1, 16)
    """
    return max(1, episodes // num_tasks) if num_tasks else episodes


def reachable(tasks: list[tuple[int, int, int]], target: float) -> bool:
    """Whether a mean success rate over tasks of ``target`` is still possible: task j has had
    ``s`` successes in ``n`` counted episodes and has ``l`` left, each assumed to succeed
    (one discarded instead only lowers its rate). A task with neither counts in no mean.

    >>> reachable([(1, 4, 0), (0, 2, 2)], 0.5)  # at best (1/4 + 2/4) / 2 = 0.375
    False
    >>> reachable([(1, 4, 0), (1, 2, 2)], 0.5)  # (1/4 + 3/4) / 2
    True
    """
    best = [(s + left) / (n + left) for s, n, left in tasks if n + left]
    # a mean of rates can round just below a target it equals: a little tolerance
    return not best or sum(best) / len(best) >= target - 1e-9


def can_reach(successes: list, left: int, target: float) -> bool:
    """Whether a success rate of ``target`` is still possible after ``successes`` (one bool per
    episode run) if all ``left`` remaining episodes succeed (discarded ones only lower it):
    ``reachable`` for one task."""
    return reachable([(sum(map(bool, successes)), len(successes), left)], target)


@dataclass
class Evaluation:
    """What ``evaluate`` counted: one ``TaskResult`` per task, each episode run (``per_episode``,
    discarded ones too), the episodes whose frames make videos, and how it ended: all rounds,
    ``curtailed`` (``reach`` out of reach) or ``interrupted`` (a stop request)."""

    tasks: list[TaskResult]
    multi_task: bool
    per_episode: list[dict] = field(default_factory=list)
    videos: list[tuple[Slot, EvalEpisode]] = field(default_factory=list)
    curtailed: bool = False
    interrupted: bool = False
    failure: Optional[BaseException] = None
    """The error that ended the loop after the rounds counted (``keep_on_failure``)."""
    results: dict = field(default_factory=dict, repr=False)
    """Each counted slot's episode by (task, episode): what a larger evaluation of the same
    weights reuses (``evaluate``'s ``known``)."""

    @property
    def episodes(self) -> int:
        """Counted episodes (not discarded), over all tasks."""
        return sum(t.episodes for t in self.tasks)

    @property
    def discarded(self) -> int:
        return sum(t.discarded for t in self.tasks)

    @property
    def asked(self) -> int:
        return sum(t.asked for t in self.tasks)

    def left(self) -> int:
        """Episodes not run yet, over all tasks."""
        return sum(t.left() for t in self.tasks)

    def add(self, slot: Slot, ep: EvalEpisode) -> None:
        """One counted slot's episode, into its task's tally."""
        self.per_episode.append({"task": slot.task, "episode": slot.episode, "seed": slot.seed,
                                 "discarded": bool(ep.discarded),
                                 "success_once": bool(ep.success_once),
                                 "success_at_end": bool(ep.success_at_end),
                                 "return": float(ep.ret), "length": int(ep.length)})
        self.tasks[slot.task].add(ep)
        self.results[(slot.task, slot.episode)] = ep
        if slot.video and ep.frames and not ep.discarded:
            self.videos.append((slot, ep))

    def mean(self, metric: str) -> float:
        """``metric``'s rate ('success_once' or 'success_at_end') averaged over the tasks with
        counted episodes (RLinf's and LIBERO's suite mean); 0.0 if none has any."""
        rates = [t.successes(metric) / t.episodes for t in self.tasks if t.episodes]
        return sum(rates) / max(1, len(rates))

    def can_reach(self, target: float, metric: str) -> bool:
        """Whether ``mean(metric)`` can still reach ``target`` once every task's episodes left
        are run (``reachable``)."""
        return reachable([(t.successes(metric), t.episodes, t.left()) for t in self.tasks],
                         target)

    def metrics(self, *, curtail: bool = False) -> dict[str, float]:
        """Training's ``eval/*`` metrics: episodes and discarded ones, return and length (means
        over counted episodes), success_once and success_at_end (means over tasks; for a
        one-task env, over its episodes); a multi-task env's ``eval/task<j>/success_once``
        and ``success_at_end`` for each task j with counted episodes; with ``curtail``,
        ``eval/curtailed`` 1 or 0. No counted episode: only their counts (and curtailed)."""
        n = self.episodes
        out = {"eval/discarded_episodes": float(self.discarded), "eval/episodes": float(n)}
        if n:
            out.update({
                "eval/return": sum(r for t in self.tasks for r in t.returns) / n,
                "eval/episode_len": sum(x for t in self.tasks for x in t.lengths) / n,
                "eval/success_once": self.mean("success_once"),
                "eval/success_at_end": self.mean("success_at_end"),
            })
        if self.multi_task:
            for t in self.tasks:
                if t.episodes:
                    out[f"eval/task{t.task}/success_once"] = t.rate(t.successes_once)
                    out[f"eval/task{t.task}/success_at_end"] = t.rate(t.successes_at_end)
        if curtail:
            out["eval/curtailed"] = float(self.curtailed)
        return out


def evaluate(eval_round: Callable, names: list[str], per_task: int, *, ranks: int,
             envs_per_rank: int, seed: int, multi_task: bool, max_steps: Optional[int] = None,
             videos_per_task: int = 0, deterministic: bool = True,
             reach: Optional[float] = None, metric: str = "success_once",
             progress=None, keep_on_stop: bool = False,
             keep_on_failure: bool = False, known: Optional[Evaluation] = None,
             first: int = 0) -> Evaluation:
    """The evaluation loop of ``m2flow-eval`` and of training: ``per_task`` episodes of each
    task in ``names`` laid out by ``episode_rounds``, one round at a time.

    Args:
        eval_round: ``EmbodiedRunner.eval_round``: one ``EvalRound`` per env worker (and
            ``deterministic=``) -> each rank's ``EvalEpisode`` list.
        names: the tasks (``spec.tasks``), or the env's name for a one-task env.
        per_task: episodes of each task.
        ranks, envs_per_rank: env workers and envs per worker (``runner.layout``).
        seed: the run's seed (a one-task env's episode seeds: ``seeding.eval_seeds``).
        multi_task: ``spec.tasks`` non-empty: episode e of task j starts from seed e.
        max_steps: env steps per episode (None: the env's time limit).
        videos_per_task: keep the frames of each task's first episodes (``Evaluation.videos``).
        deterministic: mean actions.
        reach: end after the first round from which ``Evaluation.mean(metric)`` can no longer
            reach it, even if every episode left succeeds (``curtailed``); None: never.
        progress: a ``Progress`` (``RunSession.progress``) told after each round the episodes
            done and the success so far (success_once/success_at_end over them), closed at the
            end; None: nothing shown.
        keep_on_stop: a stop request (``Stopped``) while a round runs ends the loop with the
            rounds before it (``interrupted``); False: it propagates.
        keep_on_failure: an error while a round runs (a worker that died or was killed for
            memory) ends the loop with the rounds before it (``failure``); False: it
            propagates.
        known: an evaluation of the same weights with the same seed and actions, already run
            (the smaller one that ``runner.stop_confirm_episodes`` confirms): an episode it
            counted (same task and episode, so the same initial state) is counted as it
            ended there, and a round made only of such episodes is not run again. Only
            deterministic episodes repeat, so it is refused with sampled actions.
        first: episode e starts from the seed of episode ``first + e`` (``episode_rounds``):
            ``eval.first_episode``; training's evaluation uses 0.

    A round's fillers (``Slot.episode`` None) run but are counted nowhere.
    """
    rounds = episode_rounds(len(names), per_task, ranks, envs_per_rank, seed, videos_per_task,
                            one_task_env=not multi_task, first=first)
    ev = Evaluation([TaskResult(j, n, asked=per_task) for j, n in enumerate(names)], multi_task)
    if known is not None and not deterministic:
        raise ValueError("evaluate(known=...): sampled actions do not repeat an episode")
    seen = known.results if known is not None else {}
    try:
        for rnd in rounds:
            counted = [s for row in rnd for s in row if s.episode is not None]
            if seen and all((s.task, s.episode) in seen for s in counted):
                for slot in counted:  # this round's episodes ended so already: not run again
                    ev.add(slot, seen[(slot.task, slot.episode)])
                if progress is not None:
                    progress.update(len(counted), _status(ev.tasks, rnd, names if multi_task else None))
                if reach is not None and ev.left() and not ev.can_reach(reach, metric):
                    ev.curtailed = True
                    break
                continue
            per_rank = [
                EvalRound(seeds=[s.seed for s in row],
                          tasks=[s.task for s in row] if multi_task else None,
                          max_steps=max_steps, video=[s.video for s in row])
                for row in rnd
            ]
            try:
                episodes = eval_round(per_rank, deterministic=deterministic)
            except Stopped:  # the round in flight is abandoned; the rounds before it are kept
                if not keep_on_stop:
                    raise
                ev.interrupted = True
                break
            except Exception as e:  # the round in flight is lost; the rounds before it are kept
                if not keep_on_failure:
                    raise
                ev.failure = e
                break
            for row, eps in zip(rnd, episodes):
                for slot, ep in zip(row, eps):
                    if slot.episode is not None:
                        ev.add(slot, seen.get((slot.task, slot.episode), ep))
            if progress is not None:
                progress.update(sum(s.episode is not None for row in rnd for s in row),
                                _status(ev.tasks, rnd, names if multi_task else None))
            if reach is not None and ev.left() and not ev.can_reach(reach, metric):
                ev.curtailed = True
                break
    finally:
        if progress is not None:
            progress.close()
    return ev


def run_protocol(runner, cfg, progress: bool = True) -> dict:
    """Runs the protocol with ``runner``'s workers (``evaluate``); returns the report (see
    ``write_report``).

    After each round, the episodes done of the total, the success so far and (multi-task
    envs) the task reached show in a bar on a terminal (``progress``, and
    ``runner.progress_bar``), else as a line every ``runner.progress_interval_s`` seconds.
    A stop requested meanwhile (``Stopped``: Ctrl-C, SIGTERM) ends it after the rounds
    completed: the report's ``interrupted`` is then True, its ``episodes_asked`` the total.
    A failure (a worker that died, one killed for memory) ends it the same way: ``failed``
    names its cause, ``_failure`` is the error, to raise once the partial report is written."""
    spec = runner.spec
    ev = cfg.eval
    tasks = list(spec.tasks)
    multi = bool(tasks)
    names = tasks if multi else [cfg.env.name]
    if ev.episodes_per_task:
        per_task = ev.episodes_per_task
    elif multi:
        per_task = MULTI_TASK_EPISODES
    else:
        per_task = ev.episodes or cfg.runner.eval_episodes
    max_steps = ev.max_steps or spec.max_episode_steps
    if not max_steps:
        raise ValueError(f"env {cfg.env.name!r} has no time limit; set eval.max_steps.")
    bar = runner.session.progress(f"eval {cfg.env.name}", len(names) * per_task, bar=progress)
    t0 = time.perf_counter()
    result = evaluate(runner.eval_round, names, per_task, ranks=runner.layout.env_workers,
                      envs_per_rank=runner.layout.num_envs, seed=cfg.seed, multi_task=multi,
                      max_steps=max_steps, videos_per_task=ev.videos_per_task,
                      deterministic=ev.deterministic, progress=bar, keep_on_stop=True,
                      keep_on_failure=True, first=ev.first_episode)
    rows = [r.row() for r in result.tasks]
    return {
        "env": cfg.env.name,
        "policy": cfg.policy.name,
        "checkpoint": ev.checkpoint,
        "deterministic": ev.deterministic,
        "episodes_per_task": per_task,
        "first_episode": ev.first_episode,
        "max_steps": max_steps,
        "tasks": rows,
        "groups": group_means(rows, spec.task_groups, spec.task_group_order) if multi else [],
        "mean_success_once": result.mean("success_once"),
        "mean_success_at_end": result.mean("success_at_end"),
        "episodes": result.episodes,
        "episodes_asked": result.asked,
        "interrupted": result.interrupted,
        "failed": None if result.failure is None else failure_cause(result.failure),
        "discarded": result.discarded,
        "wall_s": time.perf_counter() - t0,
        "per_episode": sorted(result.per_episode, key=lambda e: (e["task"], e["episode"])),
        "_videos": result.videos,
        "_failure": result.failure,
    }


def group_means(rows: list[dict], labels: tuple, order: tuple = ()) -> list[dict]:
    """Per group label of the tasks (``EnvSpec.task_groups``; in ``order``, then the labels
    it lacks in first-seen order): its task count, episodes, and success_once /
    success_at_end averaged over its tasks with counted episodes, as the suite's mean is; []
    without labels.

    >>> rows = [{"episodes": 2, "success_once": 1.0, "success_at_end": 0.5},
    ...         {"episodes": 2, "success_once": 0.0, "success_at_end": 0.0},
    ...         {"episodes": 0, "success_once": 0.0, "success_at_end": 0.0},
    ...         {"episodes": 2, "success_once": 0.5, "success_at_end": 0.5}]
    >>> [(g["group"], g["tasks"], g["episodes"], g["success_once"], g["success_at_end"])
    ...  for g in group_means(rows, ("hard", "easy", "easy", "hard"))]
    [('hard', 2, 4, 0.75, 0.5), ('easy', 2, 2, 0.0, 0.0)]
    >>> [g["group"] for g in group_means(rows, ("hard", "easy", "odd", "hard"), ("easy", "hard"))]
    ['easy', 'hard', 'odd']
    """
    out: dict[str, list[dict]] = {}
    for row, label in zip(rows, labels):
        out.setdefault(label, []).append(row)
    rank = {label: i for i, label in enumerate(order)}
    groups = []
    for label, members in sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))):
        counted = [r for r in members if r["episodes"]]
        groups.append({
            "group": label, "tasks": len(members),
            "episodes": sum(r["episodes"] for r in members),
            **{m: sum(r[m] for r in counted) / max(1, len(counted))
               for m in ("success_once", "success_at_end")},
        })
    return groups


def _status(results: list[TaskResult], rnd: list[list[Slot]], tasks: Optional[list[str]]) -> str:
    """``success 0.25/0.12`` (success_once/success_at_end over the episodes counted so far)
    and, for a multi-task env, the last task this round ran: ``task 4/10 pick up the black
    bowl on the ...``."""
    done = max(1, sum(r.episodes for r in results))
    once = sum(r.successes_once for r in results) / done
    text = f"success {once:.2f}/{sum(r.successes_at_end for r in results) / done:.2f}"
    if tasks is None:
        return text
    j = max(s.task for row in rnd for s in row if s.episode is not None)
    name = tasks[j] if len(tasks[j]) <= 40 else tasks[j][:37] + "..."
    return f"{text} | task {j + 1}/{len(tasks)} {name}"
