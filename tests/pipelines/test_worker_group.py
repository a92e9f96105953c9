"""Worker groups: per-rank results in rank order, rank selection, errors that keep their type
and say where they came from, fail-fast gather, waits that a stop request ends, shutdown of
calls still running, dead Ray actors, timings, and groups launched before the value their
constructors take."""

import threading
import time
from pathlib import Path

import pytest

from m2flow.pipelines import (
    Channel,
    Cluster,
    ClusterConfig,
    RankResources,
    Worker,
    WorkerError,
    WorkerGroup,
)
from m2flow.pipelines.futures import Stopped, gather, resolve

STOP_BOUND_S = 5.0  # a stop request ends a wait this soon; the calls below block 30 s or more


class Echo(Worker):
    """Runs in threads (local) or as a Ray actor (imported there as ``test_worker_group``)."""

    def __init__(self, info, prefix="r"):
        super().__init__(info)
        self.prefix, self.calls = prefix, 0

    def hello(self, x):
        self.calls += 1
        return f"{self.prefix}{self.rank}:{x}"

    def num_calls(self):
        return self.calls

    def fail(self, message):
        raise ValueError(f"{message} on rank {self.rank}")

    def wait_for(self, event, timeout=10.0):
        return event.wait(timeout)

    def finish_after_next_rank(self, events):
        """Rank r returns only after rank r+1 did: completion order is the reverse of rank order."""
        if self.rank + 1 < len(events):
            assert events[self.rank + 1].wait(10.0)
        events[self.rank].set()
        return self.rank

    def stall(self, seconds):
        return threading.Event().wait(seconds)  # nobody sets it: a call that does not return

    def read(self, channel, started, timeout=600.0):
        started.set()
        return channel.get(timeout=timeout)

    def record_phases(self):
        with self.timer("sim"):
            self.hello(0)
        self.timer.add("learn", 0.25)
        self.timer.add("learn", 0.5)


    def value_once(self, path, timeout=60.0):
        """Returns ``path``'s name once another worker created it (it waits for this value)."""
        deadline = time.monotonic() + timeout
        while not Path(path).exists():
            assert time.monotonic() < deadline, f"nobody created {path} in {timeout:g} s"
            time.sleep(0.01)
        return Path(path).name


class Taker(Worker):
    """A constructor that takes another group's result (``Futures.later``); ``path``: created
    before it waits for that result."""

    def __init__(self, info, value, path=None):
        super().__init__(info)
        if path is not None:
            Path(path).touch()
        self.value = resolve(value)

    def taken(self):
        return self.value


def ranks(n):
    return [RankResources(0, 1.0, ())] * n


@pytest.fixture
def local_group():
    group = WorkerGroup(Cluster(ClusterConfig(backend="local", num_gpus=0)), "echo", Echo, ranks(3))
    yield group
    group.shutdown()


def test_call_returns_per_rank_results_in_rank_order(local_group):
    assert local_group.call(Echo.hello, 7).wait(timeout=10) == ["r0:7", "r1:7", "r2:7"]
    events = [threading.Event() for _ in range(3)]
    assert local_group.call(Echo.finish_after_next_rank, events).wait(timeout=10) == [0, 1, 2]


def test_constructor_args_reach_every_rank():
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    group = WorkerGroup(cluster, "e", Echo, ranks(2), "x")
    try:
        assert group.call(Echo.hello, 1).wait(timeout=10) == ["x0:1", "x1:1"]
        assert [w.info.world_size for w in group.handles] == [2, 2]
    finally:
        group.shutdown()


def test_ranks_selects_which_ranks_are_called(local_group):
    assert local_group.call(Echo.hello, "a", ranks=[1]).wait(timeout=10) == ["r1:a"]
    assert local_group.call(Echo.num_calls).wait(timeout=10) == [0, 1, 0]
    assert local_group.call(Echo.hello, "b", ranks=[2, 0]).wait(timeout=10) == ["r2:b", "r0:b"]


def test_worker_exception_keeps_its_type_and_names_group_and_rank(local_group):
    with pytest.raises(ValueError, match="boom on rank 1") as ei:
        local_group.call(Echo.fail, "boom", ranks=[1]).wait(timeout=10)
    assert type(ei.value) is ValueError
    assert ei.value.__notes__ == ["(raised by worker echo[rank 1] in fail())"]


def test_gather_fails_fast_while_another_call_still_blocks(local_group):
    release = threading.Event()
    try:
        blocked = local_group.call(Echo.wait_for, release, ranks=[0])
        failing = local_group.call(Echo.fail, "boom", ranks=[2])
        with pytest.raises(ValueError, match="boom on rank 2") as ei:
            gather(blocked, failing, timeout=10)
        assert not blocked.items[0][1].done(), "gather waited for the blocked call"
        assert "echo[rank 2]" in ei.value.__notes__[0]
    finally:
        release.set()
    assert blocked.wait(timeout=10) == [True]


def test_gather_times_out_naming_the_pending_call(local_group):
    release = threading.Event()
    try:
        with pytest.raises(WorkerError, match=r"echo\[rank 1\]\.wait_for\(\) did not finish"):
            local_group.call(Echo.wait_for, release, ranks=[1]).wait(timeout=0.05)
    finally:
        release.set()


@pytest.fixture
def stop_after():
    """``stop_after(group, s)``: a stop request (as Ctrl-C makes) to ``group``'s cluster from
    another thread in s seconds; cleared after the test (a shared cluster serves the next)."""
    timers, stops = [], []

    def start(group, seconds):
        stops.append(group.stop)
        timers.append(threading.Timer(seconds, group.stop.set))
        timers[-1].start()

    yield start
    for t in timers:
        t.cancel()
    for stop in stops:
        stop.clear()


def test_a_stop_request_ends_a_wait_at_once_and_a_save_still_finishes(local_group, stop_after):
    release = threading.Event()
    try:
        blocked = local_group.call(Echo.wait_for, release, 30.0, ranks=[0])
        stop_after(local_group, 0.2)
        t0 = time.monotonic()
        with pytest.raises(Stopped, match=r"echo\.wait_for\(\)"):
            blocked.wait()
        assert time.monotonic() - t0 < STOP_BOUND_S
        assert not blocked.items[0][1].done()  # abandoned, not waited for
        with pytest.raises(Stopped):  # every later wait too
            local_group.call(Echo.hello, 1).wait()
        # a wait that must end on its own (a checkpoint being saved) is not stopped
        release.set()
        assert blocked.wait(stoppable=False) == [True]
    finally:
        release.set()


def test_a_stop_ends_the_waits_of_its_own_cluster_only():
    """Two runs in one process: the stop of one cluster (its run's Ctrl-C) ends the waits on
    its groups and their start-up, not those of the other cluster's groups."""
    stopped_cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    other = WorkerGroup(Cluster(ClusterConfig(backend="local", num_gpus=0)), "other", Echo,
                        ranks(1))
    mine = WorkerGroup(stopped_cluster, "mine", Echo, ranks(1))
    try:
        stopped_cluster.stop.set()
        with pytest.raises(Stopped, match=r"mine\.hello\(\)"):
            mine.call(Echo.hello, 1).wait()
        with pytest.raises(Stopped, match="late start-up"):
            WorkerGroup(stopped_cluster, "late", Echo, ranks(1))
        # gathered together, the stopped one's stop ends the wait
        with pytest.raises(Stopped):
            gather(other.call(Echo.hello, 2), mine.call(Echo.hello, 2))
        assert other.call(Echo.hello, 3).wait(timeout=10) == ["r0:3"]
        assert mine.call(Echo.hello, 4).wait(timeout=10, stoppable=False) == ["r0:4"]
    finally:
        mine.shutdown()
        other.shutdown()


def test_shutdown_ends_an_in_process_call_waiting_on_its_channel():
    group = WorkerGroup(Cluster(ClusterConfig(backend="local", num_gpus=0)), "reader", Echo,
                        ranks(1))
    started = threading.Event()
    waiting = group.call(Echo.read, Channel("in", group), started, 600.0).items[0][1]
    assert started.wait(10.0)
    t0 = time.monotonic()
    group.shutdown()
    # (closed while it waited, or, if it had not reached its get yet, before)
    with pytest.raises(RuntimeError, match="was closed while waited on|does not host"):
        waiting.result(timeout=STOP_BOUND_S)
    assert time.monotonic() - t0 < STOP_BOUND_S


# --- Ray ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_group(ray_cluster):
    group = WorkerGroup(ray_cluster, "echo_ray", Echo, ranks(2))
    yield group
    group.shutdown()


def test_ray_calls_run_in_separate_processes_in_rank_order(ray_group):
    assert ray_group.call(Echo.hello, 3).wait(timeout=60) == ["r0:3", "r1:3"]
    assert len(set(ray_group.call(Echo.pid).wait(timeout=60))) == 2


def test_ray_exception_keeps_its_type_and_names_group_and_rank(ray_group):
    with pytest.raises(ValueError, match="boom on rank 1") as ei:
        ray_group.call(Echo.fail, "boom", ranks=[1]).wait(timeout=60)
    assert type(ei.value) is ValueError
    (note,) = ei.value.__notes__
    assert note.startswith("(raised by worker echo_ray[rank 1] in fail()")
    assert "test_worker_group.py" in note  # the worker-side traceback comes along


def test_ray_timer_phases_come_back_and_reset_after_popping(ray_group):
    ray_group.call(Echo.record_phases, ranks=[0]).wait(timeout=60)
    timings, untouched = ray_group.call(Echo.pop_timings).wait(timeout=60)
    assert set(timings) == {"sim", "learn"}
    assert timings["learn"] == pytest.approx(0.75)
    assert 0.0 <= timings["sim"] < 5.0
    assert untouched == {}
    assert ray_group.call(Echo.pop_timings, ranks=[0]).wait(timeout=60) == [{}]


def test_ray_a_stop_request_ends_a_wait_on_a_call_that_does_not_return(ray_group, stop_after):
    stalled = ray_group.call(Echo.stall, 60.0, ranks=[1])
    stop_after(ray_group, 0.2)
    t0 = time.monotonic()
    with pytest.raises(Stopped, match=r"echo_ray\.stall\(\)"):
        stalled.wait()
    assert time.monotonic() - t0 < STOP_BOUND_S


def test_ray_killed_worker_raises_worker_error_naming_group_and_rank(ray_cluster):
    group = WorkerGroup(ray_cluster, "victim", Echo, ranks(1))
    try:
        group.kill(0)
        # ray.kill returns before the process is gone, so a quick call can still be served
        # (about 1 in 20 runs); a call that stalls ends in the death either way.
        died = r"victim\[rank 0\] in stall\(\): the worker's process died"
        with pytest.raises(WorkerError, match=died):
            group.call(Echo.stall, 60.0).wait(timeout=90)
    finally:
        group.shutdown()


def test_ray_a_launched_group_starts_before_the_value_its_constructors_take(ray_cluster, tmp_path):
    """The value comes only once the takers' constructors ran (they create the file it waits
    for): had Ray started their processes only once the value was known, nothing would come."""
    producer = WorkerGroup(ray_cluster, "producer", Echo, ranks(1))
    takers = None
    try:
        value = producer.call(Echo.value_once, str(tmp_path / "v1"), ranks=[0])
        takers = WorkerGroup.launch(ray_cluster, "takers", Taker, ranks(2), value.later(),
                                    path=str(tmp_path / "v1"))
        assert takers.started() is takers
        assert takers.call(Taker.taken).wait(timeout=60) == ["v1", "v1"]
    finally:
        for g in (takers, producer):
            if g is not None:
                g.shutdown()


def test_ray_a_failed_call_that_a_launched_group_waits_for_is_raised_as_its_own(ray_cluster):
    producer = WorkerGroup(ray_cluster, "maker", Echo, ranks(1))
    takers = WorkerGroup.launch(ray_cluster, "taker", Taker, ranks(1),
                                producer.call(Echo.fail, "boom").later())
    try:
        with pytest.raises(ValueError, match="boom on rank 0") as ei:
            takers.started()
        assert ei.value.__notes__[0].startswith("(raised by worker maker[rank 0] in fail()")
        assert takers.handles == []  # ended: a failed start-up ends the ranks it started
    finally:
        takers.shutdown()
        producer.shutdown()


def test_in_process_a_launched_group_is_built_at_once_with_the_value_itself():
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    producer = WorkerGroup(cluster, "producer", Echo, ranks(1))
    takers = WorkerGroup.launch(cluster, "takers", Taker, ranks(2),
                                producer.call(Echo.hello, 7).later())
    try:
        assert [h.value for h in takers.handles] == ["r0:7", "r0:7"]  # built in launch
        assert takers.started().call(Taker.taken).wait() == ["r0:7", "r0:7"]
    finally:
        takers.shutdown()
        producer.shutdown()
