"""The reasoning job end to end: m2flow-train, the two execution modes, m2flow-eval."""

import json

import pytest
import torch

from m2flow.cli.common import load_run_config
from m2flow.cli.eval import main as evaluate
from m2flow.cli.train import main as train

# A random tiny model gets (almost) every arithmetic answer wrong, so with groups filtered
# there would be nothing to train: these tests compare execution modes and checkpoints, not
# rewards (test_gpu_config_... and test_constant_rewards_... keep the filter on).
SMALL = ["model.tiny.num_hidden_layers=2", "model.tiny.hidden_size=64",
         "model.tiny.intermediate_size=128", "data.train_size=200", "data.test_size=16",
         "rollout.n=4", "rollout.max_new_tokens=8", "rollout.prompts_per_call=2",
         "algorithm.prompts_per_step=4", "algorithm.micro_batch_size=8",
         "algorithm.filter_groups=false", "runner.progress_bar=false"]


def test_reasoning_job_trains_with_context_switch_and_evaluates(tmp_path, capsys):
    rc = train(["--config-name", "reasoning_arith_grpo_tiny", "cluster=inprocess",
                "cluster.context_switch=always", "warm_start.steps=3", "runner.num_steps=2",
                "runner.eval_interval=1", f"runner.log_dir={tmp_path}", *SMALL])
    assert rc == 0
    out = capsys.readouterr().out
    assert "done: 2 GRPO steps" in out and "held-out accuracy" in out
    run = next(tmp_path.glob("reasoning_arith_grpo_tiny/*"))
    log = (run / "train.log").read_text()
    assert "offload" in log and "learner_learn" in log and "rollout_generate" in log
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*.pt"))
    assert ckpts == ["step_00000.pt", "step_00002.pt"]  # after the warm start, and the last
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert state["workload"] == "reasoning" and state["iteration"] == 2
    assert state["metrics"]["switch/bytes"] > 0  # rollout and learner took turns

    rc = evaluate([f"checkpoint={run / 'checkpoints' / 'last.pt'}", "cluster=inprocess",
                   "size=8", f"output_dir={tmp_path / 'eval'}"])
    assert rc == 0
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert report["problems"] == 8 and 0.0 <= report["accuracy"] <= 1.0
    assert (tmp_path / "eval" / "results.md").read_text().startswith("# held-out accuracy")


def _one_step(mode: str, tmp_path):
    from m2flow.reasoning.runner import ReasoningRunner

    cfg = load_run_config("reasoning_arith_grpo_tiny", [
        "cluster=inprocess", f"cluster.placement.mode={mode}", f"runner.log_dir={tmp_path}",
        *SMALL])
    runner = ReasoningRunner(cfg)
    try:
        metrics = runner.iterate(0)
        weights = runner.learner.call(runner.learner.worker_cls.get_weights).wait()[0]
    finally:
        runner.close()
    return runner.mode, metrics, weights


def test_collocated_and_pipelined_modes_make_the_same_update(tmp_path):
    mode_a, ma, wa = _one_step("collocated", tmp_path)
    mode_b, mb, wb = _one_step("hybrid", tmp_path)
    assert (mode_a, mode_b) == ("collocated", "pipelined")
    assert ma["train/reward"] == mb["train/reward"]  # the same completions, the same scores
    assert ma["train/tokens_trained"] == mb["train/tokens_trained"] > 0
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=k)


def test_pipelined_mode_refuses_a_shared_device(tmp_path):
    with pytest.raises(ValueError, match="placement.mode=collocated"):
        load_run_config("reasoning_arith_grpo_tiny", [
            "cluster=inprocess", "cluster.placement.mode=hybrid", "cluster.context_switch=always",
            *SMALL])


def answer_or_stop_model(tok, answer_token: str = "4"):
    """A Qwen2 whose next token is ``answer_token`` or EOS, about evenly (0.48 each), whatever
    came before: its layers write nothing (o_proj and down_proj are 0), every token embeds
    alike, and the output layer scores only those two. Its completions are "", "4", "44", ...;
    against the answer 4 about a quarter are right, so groups of 4 mostly differ."""
    import transformers

    h = 64
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=h, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)  # RMS-normed: all ones
        model.lm_head.weight.zero_()
        for t in (tok.convert_tokens_to_ids(answer_token), tok.eos_token_id):
            model.lm_head.weight[t] = 8.0 / h  # logit 8 against 0 for the 99 others
    return model


def test_gpu_config_runs_a_step_on_cpu_with_a_local_model_and_jsonl(tmp_path, monkeypatch, capsys):
    """reasoning_math_grpo_qwen's code path (a local HF directory, JSONL data, math-verify on
    the reward worker's thread, KL to the reference, gradient checkpointing) on a tiny model
    saved here, on CPU, with groups filtered as configured: the model's completions are
    right about a quarter of the time, so math-verify must score some 1 and groups are kept."""
    from m2flow.reasoning.model import tiny_tokenizer

    tok = tiny_tokenizer()
    answer_or_stop_model(tok).save_pretrained(tmp_path / "qwen")
    tok.save_pretrained(tmp_path / "qwen")
    rows = [{"problem": f"What is {i} + {4 - i}?", "answer": "\\frac{8}{2}" if i % 2 else "4"}
            for i in range(8)]
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("M2FLOW_QWEN_PATH", str(tmp_path / "qwen"))
    monkeypatch.setenv("M2FLOW_MATH_TRAIN", str(tmp_path / "train.jsonl"))
    monkeypatch.setenv("M2FLOW_MATH_TEST", str(tmp_path / "test.jsonl"))
    rc = train(["--config-name", "reasoning_math_grpo_qwen", "cluster=inprocess",
                "model.dtype=float32", "rollout.n=4", "rollout.max_new_tokens=6",
                "rollout.prompts_per_call=2", "algorithm.prompts_per_step=4",
                "algorithm.micro_batch_size=4", "data.test_size=2", "runner.num_steps=1",
                "runner.progress_bar=false", f"runner.log_dir={tmp_path / 'runs'}"])
    assert rc == 0
    assert "done: 1 GRPO steps" in capsys.readouterr().out
    run = next((tmp_path / "runs").glob("reasoning_math_grpo_qwen/*"))
    metrics = torch.load(run / "checkpoints" / "last.pt", weights_only=False)["metrics"]
    assert 0.0 < metrics["train/reward"] < 1.0
    assert metrics["train/groups_kept"] == 4 - metrics["train/groups_constant"] > 0
    assert metrics["train/tokens_trained"] > 0


def test_constant_rewards_are_reported_loudly(tmp_path, monkeypatch, capsys):
    """A reward that scores everything alike (as math-verify off the main thread once did)
    leaves GRPO nothing to learn: after runner.warn_constant_reward_steps steps the run says
    so, on stdout and in train.log."""
    from m2flow.reasoning import reward

    monkeypatch.setitem(reward.REWARDS, "exact", lambda completion, answer: 0.0)
    small = [o for o in SMALL if not o.startswith("algorithm.filter_groups")]
    rc = train(["--config-name", "reasoning_arith_grpo_tiny", "cluster=inprocess",
                "warm_start.steps=0", "runner.num_steps=2", "runner.eval_interval=0",
                "runner.warn_constant_reward_steps=2", "data.test_size=4",
                f"runner.log_dir={tmp_path}", *small])
    assert rc == 0
    line = "WARNING: no reward signal for 2 GRPO steps in a row"
    out = capsys.readouterr().out
    assert out.count(line) == 1 and "algorithm.reward=exact" in out
    log = next(tmp_path.glob("reasoning_arith_grpo_tiny/*/train.log")).read_text()
    assert log.count(line) == 1
