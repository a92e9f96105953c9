"""Channels: per-key FIFO queues with back-pressure, type checks, routing, timeouts, and one
producer -> consumer hop between two Ray actors."""

import random
import threading

import pytest

from m2flow.pipelines import (
    Channel,
    ChannelTimeout,
    Cluster,
    ClusterConfig,
    RankResources,
    Worker,
    WorkerGroup,
)
from m2flow.pipelines.channel import local_endpoint
from m2flow.pipelines.futures import gather


class Relay(Worker):
    """Moves ints through a channel; runs as a Ray actor (imported there as ``test_channel``)."""

    def produce(self, ch, n, key, timeout=30.0):
        for i in range(n):
            ch.put(i, key=key, timeout=timeout)
        ch.flush()  # a remote put's failure surfaces at the next put or here
        return n

    def consume(self, ch, n, key):
        return [ch.get(key=key, timeout=30.0) for _ in range(n)]


@pytest.fixture(scope="module")
def local_cluster():
    return Cluster(ClusterConfig(backend="local", num_gpus=0))  # num_gpus: skips torch's count


@pytest.fixture
def sink(local_cluster):
    """Factory of local receiver groups of n ranks, shut down after the test."""
    groups = []

    def make(n=1):
        groups.append(WorkerGroup(local_cluster, "sink", Worker, [RankResources(0, 1.0, ())] * n))
        return groups[-1]

    yield make
    for g in groups:
        g.shutdown()


def test_fifo_order_per_key_with_interleaved_keys(sink):
    rng = random.Random(0)
    ch = Channel("obs", sink(), capacity=100)
    sent = {k: [] for k in range(4)}
    for i in range(200):
        k = rng.randrange(4)
        ch.put((k, i), key=k)
        sent[k].append((k, i))
    got = {k: [ch.get(key=k, timeout=1.0) for _ in sent[k]] for k in reversed(range(4))}
    assert got == sent
    assert all(ch.qsize(k) == 0 for k in sent)


def test_a_full_key_does_not_block_another_key(sink):
    ch = Channel("obs", sink(), capacity=1)
    ch.put("a", key=0)
    ch.put("b", key=1, timeout=0.05)  # other key: room left
    with pytest.raises(ChannelTimeout):
        ch.put("c", key=0, timeout=0.05)
    assert (ch.get(key=1, timeout=1.0), ch.get(key=0, timeout=1.0)) == ("b", "a")


def test_put_times_out_on_a_full_key_and_succeeds_after_a_get(sink):
    ch = Channel("obs", sink(), capacity=2)
    ch.put(0)
    ch.put(1)
    with pytest.raises(ChannelTimeout, match=r"channel 'obs' key 0 stayed full \(2 items\)"):
        ch.put(2, timeout=0.05)
    assert ch.get(timeout=1.0) == 0
    ch.put(2, timeout=0.05)
    assert [ch.get(timeout=1.0) for _ in range(2)] == [1, 2]


def test_blocked_put_completes_once_the_consumer_gets(sink):
    ch = Channel("obs", sink(), capacity=1)
    ch.put("first")
    done = threading.Event()

    def producer():
        ch.put("second", timeout=10.0)
        done.set()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    assert not done.wait(timeout=0.1), "put into a full key returned without blocking"
    assert ch.get(timeout=1.0) == "first"
    assert done.wait(timeout=10.0), "blocked put did not resume after get"
    t.join(timeout=10.0)
    assert ch.get(timeout=1.0) == "second"


def test_put_of_wrong_type_raises_type_error_naming_channel(sink):
    ch = Channel("actions", sink(), item_type=int)
    with pytest.raises(TypeError, match=r"channel 'actions' carries int, got str"):
        ch.put("7")
    assert ch.qsize() == 0


def test_int_keys_route_to_rank_key_mod_world_size(sink):
    ch = Channel("obs", sink(3), capacity=4)
    for k in range(-2, 7):
        ch.put(k, key=k)
        assert ch.rank_of(k) == k % 3
        assert local_endpoint(ch.uid, k % 3).fifo(k).qsize() == 1  # landed on that rank
        for other in {0, 1, 2} - {k % 3}:
            assert local_endpoint(ch.uid, other).fifo(k).qsize() == 0


def test_tuple_keys_route_by_their_first_int(sink):
    ch = Channel("obs", sink(3))
    for k in range(6):
        for stage in ("sim", 1):
            assert ch.rank_of((k, stage)) == k % 3
    ch.put("x", key=(4, "sim"))
    assert local_endpoint(ch.uid, 1).fifo((4, "sim")).get_nowait() == "x"


def test_explicit_routes_override_the_default(sink):
    ch = Channel("obs", sink(3), routes={"learner": 2, 4: 0, (5, "s"): 1})
    assert (ch.rank_of("learner"), ch.rank_of(4), ch.rank_of((5, "s"))) == (2, 0, 1)
    assert ch.rank_of(5) == 2  # keys not in routes keep the default
    ch.put("w", key="learner")
    assert local_endpoint(ch.uid, 2).fifo("learner").get_nowait() == "w"


def test_non_int_key_without_route_raises_helpful_key_error(sink):
    ch = Channel("obs", sink(3))
    for key in ("env", ("env", 0), 1.0):
        with pytest.raises(KeyError, match=r"channel 'obs': key .* has no route") as ei:
            ch.put(1, key=key)
        assert "routes=" in str(ei.value)


def test_get_on_an_empty_key_times_out_naming_the_channel(sink):
    ch = Channel("rewards", sink())
    with pytest.raises(ChannelTimeout, match=r"channel 'rewards' key 3 got nothing"):
        ch.get(key=3, timeout=0.05)


def test_capacity_below_one_is_rejected(sink):
    with pytest.raises(ValueError, match=r"channel 'obs': capacity=0"):
        Channel("obs", sink(), capacity=0)


# --- Ray: one hop between two actor processes ------------------------------------------------


@pytest.fixture(scope="module")
def relay_groups(ray_cluster):
    ranks = [RankResources(0, 1.0, ())]
    producer = WorkerGroup(ray_cluster, "producer", Relay, ranks)
    consumer = WorkerGroup(ray_cluster, "consumer", Relay, ranks)
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


def test_ray_producer_puts_straight_into_consumer_in_order(relay_groups):
    producer, consumer = relay_groups
    ch = Channel("ints", consumer, capacity=2, item_type=int)
    n = 25  # >> capacity: the producer must wait on the consumer many times
    got = consumer.call(Relay.consume, ch, n, 0)
    sent = producer.call(Relay.produce, ch, n, 0)
    assert gather(sent, got, timeout=60) == [[n], [list(range(n))]]
    assert producer.call(Relay.pid).wait() != consumer.call(Relay.pid).wait()


def test_ray_put_into_a_full_remote_key_times_out(relay_groups):
    producer, consumer = relay_groups
    ch = Channel("ints", consumer, capacity=2, item_type=int)
    with pytest.raises(ChannelTimeout, match="channel 'ints' key 1 stayed full") as ei:
        producer.call(Relay.produce, ch, 3, 1, 0.2).wait(timeout=60)
    assert any("producer[rank 0]" in note for note in ei.value.__notes__)
