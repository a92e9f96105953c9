"""The watchdog's decisions, from timestamps alone (no Ray, no clock): which limit a phase
gets from its measured durations, and who is stalled, in which phase, for how long. The
numbers are worked by hand from the rule in ``m2flow.pipelines.watchdog``'s docstring:
limit = max(STALL_FLOOR_S, STALL_FACTOR x the phase's longest completed instance), a phase
not completed before gets FIRST_ALLOWANCE_S, and the override, when set, is every phase's
limit instead (start-up's and a phase not completed before included)."""

import pytest

from m2flow.pipelines import watchdog
from m2flow.pipelines.watchdog import StallWatch, stall_limit

ENV, LEARNER = "env[rank 0]", "learner[rank 0]"


@pytest.fixture
def rule(monkeypatch):
    """Round constants, so that the hand-worked numbers below read easily."""
    monkeypatch.setattr(watchdog, "STALL_FACTOR", 4.0)
    monkeypatch.setattr(watchdog, "STALL_FLOOR_S", 100.0)
    monkeypatch.setattr(watchdog, "FIRST_ALLOWANCE_S", 1000.0)


def test_the_limit_comes_from_the_phase_s_longest_measured_duration(rule):
    w = StallWatch(None, now=0.0)
    w.enter("collection", 50.0)  # start-up: 50 s
    w.enter("learning", 60.0)  # collection: 10 s
    assert w.limit() == 1000.0  # learning never completed: the allowance
    w.enter("collection", 90.0)  # learning: 30 s
    assert w.limit() == 100.0  # 4 x 10 = 40 s, below the floor
    w.enter("learning", 95.0)  # collection: 5 s; its longest stays 10 s
    assert w.longest == {"start-up": 50.0, "collection": 10.0, "learning": 30.0}
    assert w.limit() == 120.0  # 4 x 30 s
    w.enter("collection", 175.0)  # learning: 80 s, the longest now
    w.enter("learning", 176.0)
    assert w.limit() == 320.0  # 4 x 80 s: a long step is never cut by a shorter one's limit


def test_the_override_is_every_phase_s_limit_a_first_one_s_too(rule):
    assert stall_limit("learning", {"learning": 80.0}, 7.0) == 7.0
    assert stall_limit("learning", {"learning": 80.0}, None) == 320.0
    assert stall_limit("start-up", {}, None) == 1000.0
    assert stall_limit("start-up", {}, 7.0) == 7.0  # a start-up that stalls can be ended
    assert stall_limit("start-up", {}, 5000.0) == 5000.0
    assert watchdog.limit_origin("start-up", {}, 7.0) == "runner.stall_timeout_s"
    # a run stalled in start-up, a worker silent since it was launched (its constructor has
    # not returned): the override ends it, and the line says it never answered
    w = StallWatch(7.0, now=0.0)
    w.added(ENV, 0.0)
    w.asked(ENV, 1.0)
    assert w.stalled(6.9, grace=2.0) is None
    stall = w.stalled(7.5, grace=2.0)
    assert (stall.worker, stall.phase, stall.limit, stall.origin, stall.how) == (
        ENV, "start-up", 7.0, "runner.stall_timeout_s", watchdog.NOT_STARTED)
    w.answered(ENV, 8.0)  # it started; stopped later, it is a silent worker like any
    w.asked(ENV, 9.0)
    assert w.stalled(15.5, grace=2.0).how == watchdog.SILENT


def test_a_worker_that_answers_nothing_is_the_stall_not_the_call_waiting_on_it(rule):
    w = StallWatch(7.0, now=0.0)
    for worker in (ENV, LEARNER):
        w.added(worker, 0.0)
    w.enter("collection", 1.0)
    w.enter("learning", 2.0)
    w.enter("collection", 3.0)  # collection measured: the override (7 s) holds from here
    for worker in (ENV, LEARNER):  # the driver waits on env's collect() from 9 s on
        w.asked(worker, 9.0), w.answered(worker, 9.1)
    w.asked(LEARNER, 10.2)  # ... never answered: the learner stopped after 9.1 s
    for t in (10.2, 11.3, 12.4, 13.5, 14.6, 15.7):
        w.asked(ENV, t), w.answered(ENV, t + 0.1)
    # 16.0 s: the learner silent for 16.0 - 9.1 = 6.9 s, the wait 7.0 s: neither above 7 s
    assert w.stalled(16.0, ["env[rank 0] in collect()"], progress_at=9.0, grace=2.0) is None
    # 16.2 s: the wait on env's call is 7.2 s, but the learner answers nothing (its question
    # of 10.2 s is 6 s old): it is the stall, and the run made no progress for 7.2 s
    stall = w.stalled(16.2, ["env[rank 0] in collect()"], progress_at=9.0, grace=2.0)
    assert (stall.worker, stall.phase, stall.limit) == (LEARNER, "collection", 7.0)
    assert stall.seconds == pytest.approx(7.2)
    # with no call waited on, its own silence decides: 16.2 - 9.1 = 7.1 s
    stall = w.stalled(16.2, grace=2.0)
    assert (stall.worker, stall.seconds) == (LEARNER, pytest.approx(7.1))


def test_a_call_that_does_not_return_while_every_worker_answers_is_named(rule):
    w = StallWatch(7.0, now=0.0)
    w.added(ENV, 0.0)
    w.enter("collection", 1.0)
    w.enter("learning", 2.0)
    w.enter("collection", 3.0)
    w.asked(ENV, 9.0), w.answered(ENV, 9.1)
    assert w.stalled(9.5, ["env[rank 0] in collect()"], progress_at=3.0, grace=2.0) is None
    stall = w.stalled(10.5, ["env[rank 0] in collect()"], progress_at=3.0, grace=2.0)
    assert (stall.worker, stall.phase, stall.seconds, stall.limit) == (
        "env[rank 0] in collect()", "collection", 7.5, 7.0)
    assert "the call has not returned, though the worker answers" in stall.message(4242)


def test_a_question_just_asked_after_the_driver_was_away_is_given_its_grace(rule):
    """The driver asks only while it waits: a worker last heard from long ago, asked again
    just now, is not stalled until its question has gone unanswered for the grace."""
    w = StallWatch(7.0, now=0.0)
    w.added(ENV, 0.0)
    w.answered(ENV, 0.0)  # (started)
    w.enter("collection", 1.0)
    w.enter("checkpointing", 2.0)
    w.enter("collection", 3.0)
    w.asked(ENV, 50.0)
    assert w.stalled(51.0, grace=2.0) is None
    stall = w.stalled(52.5, grace=2.0)
    assert (stall.worker, stall.seconds) == (ENV, 52.5)  # silent since its last answer
    assert stall.message(4242).startswith(
        "worker env[rank 0] (pid 4242) stalled: no progress for 52 s during collection (its "
        "limit 7 s: runner.stall_timeout_s); it answers nothing (stopped, e.g. by SIGSTOP")


def test_a_rank_whose_constructor_returned_is_silent_not_starting_and_named_by_pid():
    """Watchdog.started: the pids that ``_m2flow_started`` returned count as each rank's first
    answer, so a later silence is a stopped worker (``SILENT``) named with its pid, however
    few questions the driver's waits gave it time to ask before (the groups launched at once
    leave none in start-up); a rank never started is still ``NOT_STARTED``. A stand-in group:
    the watchdog only reads its name, backend and handles."""
    from types import SimpleNamespace

    wd = watchdog.Watchdog(override=5.0)
    rollout = SimpleNamespace(name="rollout", backend="ray", handles=[object(), object()])
    wd.add(rollout)
    wd.started(rollout, [4242, 4343])
    learner = SimpleNamespace(name="learner", backend="ray", handles=[object()])
    wd.add(learner)  # launched, its constructor not returned
    assert wd.watch.how_silent("rollout[rank 1]") == watchdog.SILENT
    assert wd.watch.how_silent("learner[rank 0]") == watchdog.NOT_STARTED
    assert wd.pids == {"rollout[rank 0]": 4242, "rollout[rank 1]": 4343}
    stall = watchdog.Stall("rollout[rank 1]", "collection", 9.0, 5.0, "runner.stall_timeout_s",
                           watchdog.SILENT)
    assert "worker rollout[rank 1] (pid 4343) stalled" in str(wd._error(stall))
    local = SimpleNamespace(name="env", backend="local", handles=[object()])
    wd.started(local, [1])  # in-process groups are not watched
    assert "env[rank 0]" not in wd.pids
