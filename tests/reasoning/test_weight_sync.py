"""Learner -> rollout weight sync in buckets of bounded bytes: the rollout's engine ends up
holding the learner's weights bit for bit (cast to its dtype), no bucket is over the cap, and
the number of buckets is the hand-worked count for the tiny model's parameter sizes."""

import pytest
import torch

from m2flow.cli.common import load_run_config
from m2flow.reasoning.learner_worker import ReasoningLearner
from m2flow.reasoning.rollout_worker import ReasoningRollout
from m2flow.reasoning.runner import ReasoningRunner
from m2flow.runs.weights import WeightBucket, WeightSyncError
from tests.reasoning.common import learner_config, make_learner, tiny_engine

CAP = 1024  # bytes: runner.weight_sync_bucket_mb = 1/1024
# One layer, width 64 (4 heads, 2 key/value heads: k/v width 32), MLP 128, vocabulary 101,
# tied embeddings (``lm_head.weight`` is a second name of ``embed_tokens.weight``)
TINY = ["model.tiny.num_hidden_layers=1", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=128", "model.dtype=bfloat16",
        f"runner.weight_sync_bucket_mb={CAP / 2**20}"]
SMALL = ["cluster=inprocess", "data.train_size=50", "data.test_size=4", "rollout.n=4",
         "rollout.max_new_tokens=4", "rollout.prompts_per_call=2", "algorithm.prompts_per_step=2",
         "algorithm.micro_batch_size=8", "algorithm.filter_groups=false",
         "algorithm.learning_rate=1e-3", "warm_start.steps=0", "runner.progress_bar=false"]

# Buckets of one sync, worked by hand from the fp32 sizes (a row of width 64 is 256 B, so a
# (n, 64) tensor goes 4 rows a bucket; down_proj's rows are 512 B, 2 a bucket), greedily in
# state-dict order:
#   embed_tokens (101, 64): 25 buckets of 4 rows, its last row (256 B) alone  -> 26
#   q_proj (64, 64) 16; q bias (256 B) alone (k_proj's first 1024 B do not fit) -> 17
#   k_proj (32, 64) 8; k bias (128 B) alone                                     ->  9
#   v_proj 8; v bias alone                                                      ->  9
#   o_proj 16, gate_proj (128, 64) 32, up_proj 32, down_proj (64, 128) 32       -> 112
#   input_layernorm + post_attention_layernorm + norm (3 x 256 B) together      ->  1
#   lm_head as embed_tokens: 25 of 4 rows, then the last row                    -> 26
BUCKETS_PER_SYNC = 26 + 17 + 9 + 9 + 112 + 1 + 26
assert BUCKETS_PER_SYNC == 200
STEPS = 3


@pytest.fixture(autouse=True)
def reward_signal(monkeypatch):
    """A reward that varies within groups (the parity of the completion's characters): a
    random model gets every sum wrong, and equal rewards would train nothing."""
    from m2flow.reasoning import reward

    monkeypatch.setitem(reward.REWARDS, "exact",
                        lambda completion, answer: float(sum(map(ord, completion)) % 2))


class Spy:
    """Records what passes through the rollout worker's weight-sync methods."""

    def __init__(self, rollout: ReasoningRollout):
        self.manifests, self.buckets, self.finished = [], [], 0
        begin, receive, finish = (rollout.begin_weight_sync, rollout.receive_weight_bucket,
                                  rollout.finish_weight_sync)

        def on_begin(manifest, *, version):
            self.manifests.append((manifest.full, len(manifest.buckets), version))
            return begin(manifest, version=version)

        def on_receive(bucket):
            self.buckets.append(bucket)
            return receive(bucket)

        def on_finish():
            self.finished += 1
            return finish()

        rollout.begin_weight_sync = on_begin
        rollout.receive_weight_bucket = on_receive
        rollout.finish_weight_sync = on_finish


def nbytes(bucket: WeightBucket) -> int:
    return (sum(t.numel() * t.element_size() for t in bucket.whole.values())
            + sum(t.numel() * t.element_size() for _, _, t in bucket.rows))


def assert_within_cap(bucket: WeightBucket) -> None:
    """At most CAP bytes, or one single row larger than the cap alone."""
    if nbytes(bucket) > CAP:
        assert not bucket.whole and len(bucket.rows) == 1 and bucket.rows[0][2].shape[0] == 1


def assert_same_weights(engine_model, learner_state: dict) -> None:
    """Every tensor of the engine's model equals the learner's cast to its dtype, bit for bit."""
    own = engine_model.state_dict()
    assert sorted(own) == sorted(learner_state)
    for k, v in own.items():
        assert v.dtype == torch.bfloat16, k
        assert torch.equal(v, learner_state[k].to(v.dtype)), k


def test_grpo_steps_sync_the_engine_bucket_by_bucket(tmp_path):
    """After each GRPO step the runner sends the learner's weights in buckets of at most 1 KB
    (an update changes all of them); the engine's model then equals the learner's."""
    cfg = load_run_config("reasoning_arith_grpo_tiny",
                          [*TINY, *SMALL, f"runner.log_dir={tmp_path}"])
    runner = ReasoningRunner(cfg)
    try:
        rollout, learner = runner.rollout.handles[0], runner.learner.handles[0]
        spy = Spy(rollout)
        initial = {k: v.clone() for k, v in rollout.engine.model.state_dict().items()}
        for step in range(STEPS):
            assert runner.iterate(step)["train/groups_constant"] < 2
        assert rollout.version == STEPS
        learner_state = learner.model.state_dict()
        assert all(v.dtype == torch.float32 for v in learner_state.values())  # fp32 masters
        assert_same_weights(rollout.engine.model, learner_state)
        moved = sum(int((v != initial[k]).sum()) for k, v in rollout.engine.model.state_dict().items())
        assert moved > 1000  # the syncs carried updates that survive the cast to bf16
    finally:
        runner.close()
    # the first sync is full, later ones ship the trainable parameters: all of them here
    assert spy.manifests == [(True, BUCKETS_PER_SYNC, 1), (False, BUCKETS_PER_SYNC, 2),
                             (False, BUCKETS_PER_SYNC, 3)]
    assert len(spy.buckets) == STEPS * BUCKETS_PER_SYNC and spy.finished == STEPS
    for bucket in spy.buckets:
        assert_within_cap(bucket)
    rows = [t.shape[0] for b in spy.buckets for _, _, t in b.rows]
    assert max(nbytes(b) for b in spy.buckets) == CAP and rows.count(1) == STEPS * 2


def test_resume_and_evaluation_send_the_checkpoint_in_buckets(tmp_path):
    cfg = load_run_config("reasoning_arith_grpo_tiny", [
        *TINY, *SMALL, f"runner.log_dir={tmp_path}", "runner.num_steps=1",
        "runner.eval_interval=0"])
    runner = ReasoningRunner(cfg)
    try:
        path = runner.train()["checkpoint"]
        saved = {k: v.clone() for k, v in runner.learner.handles[0].model.state_dict().items()}
    finally:
        runner.close()
    resumed_cfg = load_run_config("reasoning_arith_grpo_tiny",
                                  [*TINY, *SMALL, f"runner.log_dir={tmp_path}", f"resume={path}"])
    torch.manual_seed(123)  # nothing depends on the seed of the process
    resumed = ReasoningRunner(resumed_cfg)  # loads the checkpoint and syncs it, full
    try:
        assert resumed.iteration == 1 and resumed.rollout.handles[0].version == 1
        assert_same_weights(resumed.rollout.handles[0].engine.model, saved)
    finally:
        resumed.close()

    evaluator = ReasoningRunner(cfg, train=False)
    try:
        rollout = evaluator.rollout.handles[0]
        spy = Spy(rollout)
        initial = rollout.engine.model.state_dict()
        moved = sum(int((v != saved[k].to(v.dtype)).sum()) for k, v in initial.items())
        assert moved > 1000  # the checkpoint is not the initial weights the rollout starts with
        evaluator.load_policy(torch.load(path, weights_only=False))
        assert_same_weights(rollout.engine.model, saved)
        assert spy.manifests == [(True, BUCKETS_PER_SYNC, 1)] and rollout.version == 1
        for bucket in spy.buckets:
            assert_within_cap(bucket)
    finally:
        evaluator.close()


def test_learner_prepares_full_syncs_first_and_after_a_load():
    learner = make_learner(learner_config(kl_coef=0.0))
    names = list(learner.model.state_dict())
    params = {n for n, p in learner.model.named_parameters()}
    first = learner.prepare_weight_sync(bucket_mb=1.0)
    assert first.full and first.keys == names
    later = learner.prepare_weight_sync(bucket_mb=1.0)
    assert not later.full and set(later.keys) >= params  # every parameter is trained
    learner.load_state_dict(learner.state_dict())
    assert learner.prepare_weight_sync(bucket_mb=1.0).full


def test_the_engine_refuses_a_name_its_model_lacks_and_a_missing_tensor():
    engine = tiny_engine(n_layers=2)
    names = list(engine.model.state_dict())
    sink = engine.weight_receiver()
    with pytest.raises(WeightSyncError, match="does not have"):
        sink.begin(names + ["model.layers.9.mlp.up_proj.weight"], full=True)
    sink.begin(names, full=False)
    sink.receive(WeightBucket(whole={names[1]: torch.zeros(engine.model.state_dict()[names[1]].shape)}))
    with pytest.raises(WeightSyncError, match="did not arrive whole"):
        sink.finish()


def test_bucket_size_is_a_field_that_must_be_positive():
    cfg = load_run_config("reasoning_arith_grpo_tiny", [])
    assert cfg.runner.weight_sync_bucket_mb == 256.0
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match=r"runner.weight_sync_bucket_mb=.*must be > 0; give"):
            load_run_config("reasoning_arith_grpo_tiny", [f"runner.weight_sync_bucket_mb={bad}"])
