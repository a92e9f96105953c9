"""Reasoning GRPO: maths against hand-computed values, rewards, data, models, the learner."""

import json
import math

import pytest
import torch

from m2flow.cli.common import load_run_config
from m2flow.configs import ConfigError
from m2flow.reasoning.config import DataConfig, ModelConfig
from m2flow.reasoning.data import DataError, make_datasets
from m2flow.reasoning.grpo import token_loss
from m2flow.runs.rl import group_advantages
from m2flow.reasoning.model import (
    ModelError,
    load_model,
    sequence_logprobs,
    tiny_tokenizer,
)
from m2flow.reasoning.reward import exact_match, math_verify_reward
from tests.reasoning.common import (
    ListChannel,
    learner_config,
    make_learner,
    scored_groups,
    tiny_engine,
)


# -- GRPO maths ----------------------------------------------------------------------------
def test_group_advantages_hand_computed():
    """Population std, worked by hand. [1,0,0,1]: mean 1/2, std 1/2 -> +1,-1,-1,+1.
    [2,0,1]: mean 1, std sqrt(2/3) -> +-sqrt(3/2), 0. [3,1] with eps 0.5: std 1 -> +-1/1.5."""
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]
    adv = group_advantages(torch.tensor([2.0, 0.0, 1.0]), 3, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5 ** 0.5, -(1.5 ** 0.5), 0.0]))
    adv = group_advantages(torch.tensor([3.0, 1.0]), 2, eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([1 / 1.5, -1 / 1.5]))


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("value", [1.0, 0.0, 0.1, 1 / 3])
def test_a_constant_group_has_zero_advantages_for_any_eps(value, eps):
    """No signal means advantage 0 exactly: not 0/0 = nan (eps 0), and not the rounding
    residue of a mean that is not representable, divided by eps."""
    rewards = torch.tensor([value] * 7 + [1.0, 0.0])
    adv = group_advantages(rewards[:7], 7, eps=eps)
    assert torch.equal(adv, torch.zeros(7))
    adv = group_advantages(rewards[-2:], 2, eps=eps)  # a group with a signal still has one
    assert adv.abs().min() > 0.99


def test_token_loss_hand_computed():
    """Token 1: ratio 1.5, A=+1 -> clipped at 1.2 -> -1.2. Token 2: ratio 0.5, A=-1 ->
    max(0.5, 0.8) = 0.8. Token 3 is masked. With kl_coef 0.1 and ref/new = 2 on token 1:
    k3 = 2 - ln 2 - 1."""
    old = torch.zeros(2, 2)
    new = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 5.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, False], [True, False]])
    loss, stats = token_loss(new, old, adv, mask, clip_coef=0.2)
    assert loss.item() == pytest.approx(-1.2 + 0.8)
    assert stats["clip_fraction"].item() == pytest.approx(2.0)  # both tokens clipped
    ref = new.clone()
    ref[0, 0] += math.log(2.0)
    loss_kl, stats = token_loss(new, old, adv, mask, 0.2, ref_logp=ref, kl_coef=0.1)
    assert loss_kl.item() == pytest.approx(-1.2 + 0.8 + 0.1 * (2 - math.log(2) - 1), abs=1e-6)
    assert stats["kl_ref"].item() == pytest.approx(2 - math.log(2) - 1, abs=1e-6)


def test_token_loss_gradient_pushes_up_good_tokens():
    logits = torch.zeros(1, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :1]  # log-prob of token 0
    loss, _ = token_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), 0.2)
    loss.backward()
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]  # descent raises token 0's logit


# -- rewards -------------------------------------------------------------------------------
@pytest.mark.parametrize("completion,answer,expected", [
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("so x = $\\frac{1}{2}$", "0.5", 1.0),
    ("$\\boxed{\\frac{3}{6}}$", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{41}.", "42", 0.0),
    ("\\boxed{\\frac{1}{", "0.5", 0.0),   # malformed LaTeX
    ("", "42", 0.0),                      # nothing
    ("I do not know", "7", 0.0),          # no answer at all
])
def test_math_verify_reward(completion, answer, expected):
    assert math_verify_reward(completion, answer) == expected


def test_exact_match_reads_the_last_number():
    assert exact_match(" 12+7=19", "19") == 1.0
    assert exact_match(" 12+7=18", "19") == 0.0
    assert exact_match(" 19=12+7", "19") == 0.0  # the last number counts
    assert exact_match("=", "19") == 0.0


# -- data ----------------------------------------------------------------------------------
def test_arithmetic_answers_are_exact_and_test_is_held_out():
    train, test = make_datasets(DataConfig(train_size=500, test_size=100, max_terms=3))
    for p in train + test:
        expr = p.solution.strip().split("=")[0]
        assert eval(expr) == int(p.answer) >= 0
    assert not {p.question for p in train} & {p.question for p in test}
    again, _ = make_datasets(DataConfig(train_size=500, test_size=100, max_terms=3))
    assert again == train  # seeded


def test_jsonl_and_parquet_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(10)]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    for name, source in (("m.jsonl", "jsonl"), ("m.parquet", "parquet")):
        cfg = DataConfig(source=source, train_path=str(tmp_path / name), prompt_key="problem",
                         test_size=3)
        train, test = make_datasets(cfg)
        assert len(train) == 7 and len(test) == 3 and test[0].answer == "14"
    with pytest.raises(DataError, match="data.prompt_key"):
        make_datasets(DataConfig(source="jsonl", train_path=str(tmp_path / "m.jsonl"), test_size=3))
    with pytest.raises(DataError, match="data.train_path"):
        make_datasets(DataConfig(source="jsonl", train_path=str(tmp_path / "nope.jsonl")))


# -- models and generation -----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_local_hf_directory_loads_with_equal_logits(tmp_path, arch):
    cfg = ModelConfig()
    cfg.tiny.architecture, cfg.tiny.num_hidden_layers = arch, 2
    torch.manual_seed(0)
    model, tok = load_model(cfg)
    model.save_pretrained(tmp_path / arch)
    tok.save_pretrained(tmp_path / arch)
    loaded, tok2 = load_model(ModelConfig(path=str(tmp_path / arch)))
    assert type(loaded) is type(model)
    ids = torch.tensor([tok("Q: 2+3?\nA: 5")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert tok2("Q: 2+3?")["input_ids"] == tok("Q: 2+3?")["input_ids"]


def test_bad_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelError, match="model.path"):
        load_model(ModelConfig(path=str(tmp_path)))
    with pytest.raises(ConfigError, match="model.path"):
        load_run_config("reasoning_arith_grpo_tiny", [f"model.path={tmp_path}"])


def test_config_names_are_checked():
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_run_config("reasoning_arith_grpo_tiny", ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="algorithm.reward"):
        load_run_config("reasoning_arith_grpo_tiny", ["algorithm.reward=regex"])
    with pytest.raises(ConfigError, match="algorithm.rewrd"):
        load_run_config("reasoning_arith_grpo_tiny", ["algorithm.rewrd=exact"])
    with pytest.raises(ConfigError, match="runner.warn_constant_reward_steps=-1: must be >= 0"):
        load_run_config("reasoning_arith_grpo_tiny", ["runner.warn_constant_reward_steps=-1"])
    assert load_run_config("reasoning_arith_grpo_tiny", []).runner.warn_constant_reward_steps == 5


def test_rollout_logprobs_equal_the_training_forward():
    engine = tiny_engine(temperature=0.7)
    out = engine.generate(["Q: a\nA:", "Q: a longer one\nA:"], 4, seed=3)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1).long()
    with torch.no_grad():
        lp = sequence_logprobs(engine.model, ids, mask, out["prompt_ids"].shape[1], 0.7)
    m = out["completion_mask"]
    assert m.any()
    torch.testing.assert_close(lp[m], out["logprobs"][m], atol=1e-5, rtol=0)
    again = engine.generate(["Q: a\nA:", "Q: a longer one\nA:"], 4, seed=3)
    assert torch.equal(again["completion_ids"], out["completion_ids"])  # seeded per call


def test_tokenizer_round_trip():
    tok = tiny_tokenizer()
    text = "Q: There are 19 keys in a box.\nA: 19-17=2"
    assert tok.decode(tok(text)["input_ids"]) == text


# -- the learner: micro-batching does not change the update ---------------------------------
def test_update_is_the_same_for_any_micro_batch_size():
    groups = scored_groups(tiny_engine())
    a = make_learner(learner_config(micro_batch=4))
    b = make_learner(learner_config(micro_batch=16))
    ma = a.update(ListChannel([g.clone() for g in groups]), num_groups=4, iteration=0)
    mb = b.update(ListChannel([g.clone() for g in groups]), num_groups=4, iteration=0)
    assert ma["train/groups_kept"] == 2.0  # the all-correct groups are filtered out
    assert ma["train/tokens_trained"] == mb["train/tokens_trained"] > 0
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=2e-6, msg=name)
    changed = any(not torch.equal(pa, pr) for pa, pr in zip(a.model.parameters(), a.ref.parameters()))
    assert changed  # the step moved the policy away from its reference


def test_grpo_step_raises_the_rewarded_completions_logprob():
    engine = tiny_engine()
    groups = scored_groups(engine, n_groups=2)
    learner = make_learner(learner_config(micro_batch=8))
    learner.cfg.algorithm.learning_rate = 1e-3
    learner.optimizer.param_groups[0]["lr"] = 1e-3
    learner.model.load_state_dict(engine.model.state_dict())

    def mean_lp(group):
        ids = torch.cat([group["prompt_ids"], group["completion_ids"]], 1)
        mask = torch.cat([group["prompt_mask"], group["completion_mask"]], 1).long()
        with torch.no_grad():
            lp = sequence_logprobs(learner.model, ids, mask, group["prompt_ids"].shape[1])
        return (lp * group["completion_mask"]).sum(-1)

    before = mean_lp(groups[0])
    learner.update(ListChannel([g.clone() for g in groups]), num_groups=2, iteration=0)
    after = mean_lp(groups[0])
    good = groups[0]["reward"] == 1
    assert (after - before)[good].mean() > (after - before)[~good].mean()
