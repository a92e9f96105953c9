"""Configs of a reasoning run (GRPO for a causal language model), composed by Hydra like the
embodied ones. The ``cluster`` group is the same: placement decides collocated (rollout and
learner take turns on one device) or disaggregated-pipelined execution."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from m2flow.fields import above, at_least, check_bound, one_of
from m2flow.runs.config import ClusterGroupConfig, RunnerBaseConfig


@dataclass
class DataConfig:
    """Prompts with reference answers: generated arithmetic, or local JSONL/Parquet files."""

    source: str = "arithmetic"
    """arithmetic (built-in word problems with exact answers) | jsonl | parquet."""
    train_path: Optional[str] = None
    """jsonl/parquet: the training file (one problem per line/row)."""
    test_path: Optional[str] = None
    """jsonl/parquet: the held-out file (None: the last ``test_size`` rows of train_path)."""
    prompt_key: str = "prompt"
    """Field holding the question."""
    answer_key: str = "answer"
    """Field holding the reference answer."""
    template: str = "Q: {prompt}\nA:"
    """How a question becomes the model's prompt."""
    train_size: int = 20000
    """arithmetic: problems generated for training (file sources: at most this many)."""
    test_size: int = 200
    """Held-out problems (arithmetic: generated from another seed, none shared with train)."""
    max_operand: int = 20
    """arithmetic: operands are drawn from 0..max_operand."""
    max_terms: int = 2
    """arithmetic: numbers per problem (2 or 3)."""

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "data.train_size", at_least(1),
                    "give the training problems to use (e.g. 20000)")
        check_bound(self, "data.test_size", at_least(1), "give the held-out problems (e.g. 200)")
        check_bound(self, "data.max_operand", at_least(1),
                    "give the largest operand of a problem (e.g. 20)")
        check_bound(self, "data.max_terms", one_of((2, 3)), "numbers per arithmetic problem")


@dataclass
class TinyModelConfig:
    """A random-init causal LM from ``transformers`` for CPU runs (used when model.path is None)."""

    architecture: str = "qwen2"
    """qwen2 | llama."""
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "model.tiny.hidden_size", at_least(1),
                    "give the tiny model's width (e.g. 128)")
        check_bound(self, "model.tiny.intermediate_size", at_least(1),
                    "give the MLP width (e.g. 512)")
        check_bound(self, "model.tiny.num_hidden_layers", at_least(1),
                    "give the number of layers (e.g. 4)")
        check_bound(self, "model.tiny.num_attention_heads", at_least(1),
                    "give the attention heads (e.g. 4)")
        check_bound(self, "model.tiny.num_key_value_heads", at_least(1),
                    "give the key/value heads (e.g. 2)")
        check_bound(self, "model.tiny.max_position_embeddings", at_least(2),
                    "give the longest sequence (e.g. 256)")


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """A local Hugging Face causal-LM directory (config.json, safetensors, tokenizer files);
    loaded with from_pretrained and no network. None: the tiny preset below."""
    dtype: str = "auto"
    """auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    gradient_checkpointing: bool = False


@dataclass
class GenerationConfig:
    """The rollout worker: ``n`` sampled completions per prompt."""

    engine: str = "hf"
    """Generation backend: hf (transformers generate, KV cache). vLLM/SGLang backends plug in
    through m2flow.reasoning.engine.ENGINES."""
    n: int = 8
    """Completions per prompt (the GRPO group)."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    """0: no top-k cut."""
    prompts_per_call: int = 8
    """Prompts per generate call; each call's groups stream on as soon as it returns."""
    eval_batch_size: int = 64
    """Prompts per greedy generate call during evaluation."""

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "rollout.n", at_least(2),
                    "GRPO scores each completion against its group: sample 2 or more per prompt "
                    "(e.g. 8)")
        check_bound(self, "rollout.max_new_tokens", at_least(1),
                    "give the tokens a completion may have (e.g. 16)")
        check_bound(self, "rollout.temperature", above(0), "sample with e.g. 1.0")
        check_bound(self, "rollout.top_k", at_least(0), "give k, or 0 for no top-k cut")
        check_bound(self, "rollout.prompts_per_call", at_least(1),
                    "give the prompts per generate call (e.g. 8)")
        check_bound(self, "rollout.eval_batch_size", at_least(1),
                    "give the prompts per evaluation call (e.g. 64)")


@dataclass
class ReasoningGRPOConfig:
    """GRPO for language models: group-normalised advantages, token-level clipped loss."""

    name: str = "grpo"
    learning_rate: float = 1e-4
    prompts_per_step: int = 16
    """Prompts (groups) per GRPO step."""
    micro_batch_size: int = 32
    """Completions per forward/backward; gradients accumulate over the step."""
    clip_coef: float = 0.2
    kl_coef: float = 0.0
    """Weight of the KL to the reference (the initial) model; 0: no reference model kept."""
    max_grad_norm: float = 1.0
    eps: float = 1e-6
    """Added to the group std."""
    filter_groups: bool = True
    """Skip groups whose completions all got the same reward (their advantages are 0)."""
    reward: str = "exact"
    """exact (the last number in the completion equals the answer) | math_verify."""
    weight_decay: float = 0.0

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "algorithm.learning_rate", above(0), "give Adam's step size, e.g. 1e-4")
        check_bound(self, "algorithm.prompts_per_step", at_least(1),
                    "give the prompts (groups) per GRPO step")
        check_bound(self, "algorithm.micro_batch_size", at_least(1),
                    "give the completions per forward/backward")
        check_bound(self, "algorithm.clip_coef", above(0), "give the ratio clip range, e.g. 0.2")
        check_bound(self, "algorithm.kl_coef", at_least(0), "give the KL weight, or 0 for none")
        check_bound(self, "algorithm.max_grad_norm", above(0),
                    "give the gradient-norm clip, e.g. 1.0")
        check_bound(self, "algorithm.eps", above(0),
                    "give the small number added to the group std, e.g. 1e-6")
        check_bound(self, "algorithm.weight_decay", at_least(0),
                    "give AdamW's weight decay, or 0")


@dataclass
class WarmStartConfig:
    """Optional supervised warm start on the training set's reference solutions, before GRPO."""

    steps: int = 0
    """SFT steps (0: none)."""
    batch_size: int = 64
    learning_rate: float = 1e-3

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "warm_start.steps", at_least(0), "give the SFT steps, or 0 for none")
        check_bound(self, "warm_start.batch_size", at_least(1),
                    "give the SFT batch size (e.g. 64)")
        check_bound(self, "warm_start.learning_rate", above(0),
                    "give the SFT step size, e.g. 1e-3")


@dataclass
class ReasoningRunnerConfig(RunnerBaseConfig):
    num_steps: int = 100
    """GRPO steps at most."""
    eval_interval: int = 10
    """Evaluate held-out accuracy every N steps (and before the first and after the last)."""
    checkpoint_interval: int = 50
    """Save every N steps (and after the warm start and the last step); 0: only those."""
    warn_constant_reward_steps: int = 5
    """Warn (log and stdout) after this many GRPO steps in a row whose every group got equal
    rewards: no learning signal (advantages 0; filter_groups drops them all); 0: never."""
    weight_sync_bucket_mb: float = 256.0
    """Weight sync from learner to rollout: the most MB of one bucket (one Ray object; a tensor
    larger than this travels in row ranges), so the object store never holds the whole model
    (~15 GB at 7B). Each step ships what the update changed (every parameter: the whole
    model is fine-tuned); the first sync after start or resume ships every tensor."""

    def validate(self) -> None:
        """Raises FieldError naming the first of its own fields out of range (those of
        RunnerBaseConfig: ``validate_base``)."""
        check_bound(self, "runner.num_steps", at_least(1),
                    "set it to the number of GRPO steps to run")
        check_bound(self, "runner.eval_interval", at_least(0),
                    "evaluate every N steps, or 0 for first and last only")
        check_bound(self, "runner.warn_constant_reward_steps", at_least(0),
                    "warn after N steps in a row without a reward signal (e.g. 5), or 0 for "
                    "never")
        check_bound(self, "runner.weight_sync_bucket_mb", above(0),
                    "give the most MB of one weight-sync bucket (default 256)")


@dataclass
class ReasoningEvalConfig:
    """``m2flow-eval`` on a reasoning checkpoint: held-out accuracy, greedy decoding."""

    checkpoint: Optional[str] = None
    """A .pt written by m2flow-train for a reasoning config; None: the initial weights."""
    size: int = 0
    """Held-out problems to score (0: all of data.test_size)."""
    output_dir: Optional[str] = None
    samples: int = 20
    """Problems whose completions are written into the report."""

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "eval.size", at_least(0),
                    "give the held-out problems to score, or 0 for data.test_size")
        check_bound(self, "eval.samples", at_least(0),
                    "give the completions to write into the report")


@dataclass
class ReasoningConfig:
    """The root config of a reasoning run."""

    workload: str = "reasoning"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: GenerationConfig = field(default_factory=GenerationConfig)
    algorithm: ReasoningGRPOConfig = field(default_factory=ReasoningGRPOConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    cluster: ClusterGroupConfig = field(default_factory=ClusterGroupConfig)
    runner: ReasoningRunnerConfig = field(default_factory=ReasoningRunnerConfig)
    eval: ReasoningEvalConfig = field(default_factory=ReasoningEvalConfig)
    seed: int = 0
    resume: Optional[str] = None
    """Checkpoint path to continue training from; ``latest`` / ``auto``: the newest of the
    runs named ``run_name`` (see the embodied ``TrainConfig.resume``)."""
    run_name: str = "reasoning"
