"""Response generation (`actor_rollout_ref.rollout`): which engine, how it samples, how much memory it takes.

The vLLM-style fields (gpu_memory_utilization, max_num_seqs, enforce_eager, ...) keep
their meaning for ember's own engine, which is built on the same paged-KV design.
"""

from dataclasses import dataclass
from typing import Any, Literal

from ember.config.schema.base import field_, follow, section

RolloutName = Literal["ember", "hf", "vllm", "sglang"]
STAND_IN_NAMES = ("vllm", "sglang")
"""Engines ember does not ship, whose names run on ember's own engine (scripts written for verl set them)."""
RolloutDType = Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]

_ACTOR = "actor_rollout_ref.actor"


@dataclass
class ValidationSamplingConfig:
    """Sampling used for validation generations (greedy by default)."""

    top_k: int = field_(-1, "sample from the k most likely tokens; -1 = no limit")
    top_p: float = field_(1.0, "nucleus sampling probability mass")
    temperature: float = field_(0.0, "sampling temperature; 0 = greedy")
    n: int = field_(1, "responses per validation prompt")
    do_sample: bool = field_(False, "sample; false = greedy decoding")


ToolResponseTruncateSide = Literal["left", "right", "middle"]


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's `rollout.multi_turn`): the agent loop of `ember/agent/`."""

    enable: bool = field_(
        False, "generate each sample as turns: the model's turn, its tool calls run, their responses appended as "
               "tokens, the model's next turn; needs tool_config_path and rollout.name=ember")
    max_assistant_turns: int | None = field_(None, "most model turns per sample; null = until response_length")
    max_user_turns: int | None = field_(
        None, "most tool-response turns per sample (verl counts tool turns as user turns); null = no limit")
    tool_config_path: str | None = field_(
        None, "YAML of the tools (verl's format: tools: [{class_name, config, tool_schema}])")
    max_parallel_calls: int = field_(1, "tool calls of one model turn that run; later calls of the turn are dropped")
    max_tool_response_length: int = field_(256, "characters of a tool's response kept (cut at tool_response_truncate_side)")
    tool_response_truncate_side: ToolResponseTruncateSide = field_(
        "middle", "which part of a long tool response is cut: left keeps the start, right the end, middle both ends")
    format: Literal["hermes"] = field_(
        "hermes", "tool-call format the model writes: hermes = <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>")
    tool_timeout: float = field_(
        30.0, "ember: seconds one tool call (create + execute) may take before it counts as a failed call")


@dataclass
class RolloutConfig:
    """Generation engine and sampling for training rollouts."""

    name: RolloutName = field_(
        "ember", "generation engine: ember (ember's own: paged KV cache, continuous batching, CUDA graphs), "
        "hf (transformers generate on the actor's module, the reference); vllm and sglang run on ember's engine "
        "(see require_named_engine)")
    require_named_engine: bool = field_(
        False, "true: a name of an engine ember does not ship (vllm, sglang) stops the run instead of running on "
               "ember's own engine")
    mode: Literal["sync", "async"] = field_(
        "sync", "verl: sync generates in the trainer's workers, async through a rollout server for agent loops; ember "
                "generates in its workers either way, and async is accepted with multi_turn.enable (ember's agent loop "
                "always keeps other samples generating while a sample's tools run)")
    temperature: float = field_(1.0, "sampling temperature")
    top_k: int = field_(-1, "sample from the k most likely tokens; -1 = no limit")
    top_p: float = field_(1.0, "nucleus sampling probability mass")
    prompt_length: int = follow("data.max_prompt_length", "longest prompt in tokens")
    response_length: int = follow("data.max_response_length", "most tokens generated per response")
    dtype: RolloutDType = field_("auto", "dtype of the generation weights; auto = bfloat16 on GPU, float32 on CPU")
    quantization: Literal["fp8"] | None = field_(
        None, "verl: quantise the generation weights; fp8 = the decoder's q/k/v/o and gate/up/down (dense MLPs, shared "
              "experts) in float8 e4m3 with one fp32 scale per output channel, quantised at load and at every weight "
              "sync, inputs quantised per token (torch._scaled_mm on GPUs of compute capability 8.9+, bfloat16); the "
              "embedding, norms, MoE router, routed experts and LM head stay in dtype; null = none")
    gpu_memory_utilization: float = field_(
        0.5, "fraction of GPU memory the engine may use for its own weights and KV cache (memory the actor holds beside "
             "it does not count, except that the cache never takes more than is free)")
    ignore_eos: bool = field_(False, "keep generating after the end-of-sequence token until response_length")
    enforce_eager: bool = field_(False, "run decode steps eagerly; false = replay them as captured CUDA graphs (GPU)")
    free_cache_engine: bool = field_(True, "release the KV cache between rollouts so training can use the memory")
    tensor_model_parallel_size: int = field_(
        1, "GPUs one engine instance spans (tensor parallel: heads, KV cache, MLP and expert widths, embedding and "
           "LM head by vocabulary split; each instance generates its share of the prompts)")
    data_parallel_size: int = field_(
        1, "verl: data-parallel ranks inside one vLLM/SGLang engine (data-parallel attention for MoE); ember's "
           "engine runs one instance per tensor_model_parallel_size GPUs of the actor's pool, each generating its "
           "share (no effect)")
    max_num_batched_tokens: int = field_(8192, "most tokens one engine step processes")
    max_model_len: int | None = field_(None, "longest sequence the engine accepts; null = prompt_length + response_length")
    max_num_seqs: int = field_(1024, "most sequences decoded at once")
    enable_chunked_prefill: bool = field_(True, "split long prefills into chunks interleaved with decoding")
    load_format: str = field_("dummy_dtensor", "how an external engine initialises its weights before the first sync")
    log_prob_micro_batch_size: int | None = field_(
        None, "deprecated: micro-batch over all GPUs; use log_prob_micro_batch_size_per_gpu")
    log_prob_micro_batch_size_per_gpu: int | None = field_(
        None, "responses per forward when recomputing old log-probs; null = whole per-GPU batch")
    log_prob_use_dynamic_bsz: bool = follow(f"{_ACTOR}.use_dynamic_bsz", "form log-prob micro-batches by token count")
    log_prob_max_token_len_per_gpu: int = follow(
        f"{_ACTOR}.ppo_max_token_len_per_gpu", "tokens per log-prob micro-batch with dynamic batch size")
    do_sample: bool = field_(True, "sample; false = greedy decoding")
    n: int = field_(1, "responses sampled per prompt (the group size of GRPO)")
    calculate_log_probs: bool = field_(
        False, "verl: also return the engine's log-probs of the sampled tokens; ember's engines always return them "
               "(rollout_log_probs; no effect)")
    seed: int = field_(0, "seed of the sampler")
    engine_kwargs: dict[str, Any] = field_(
        {"vllm": {}, "sglang": {}}, "extra arguments per external engine (engine_kwargs.vllm.*, engine_kwargs.sglang.*)")
    val_kwargs: ValidationSamplingConfig = section(ValidationSamplingConfig, "sampling for validation")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "multi-turn rollouts with tools")

    @property
    def engine(self) -> str:
        """The engine that runs: `name`, except that ember's own engine stands in for vllm and sglang."""
        return "ember" if self.name in STAND_IN_NAMES else self.name
