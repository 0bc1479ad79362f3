"""HFRollout: generation with transformers' `model.generate`, sharing the training module (hybrid engine).

In the hybrid setup the rollout engine holds a reference to the actor's nn.Module (plain,
or wrapped by FSDP2 at world size 1) and generates with it directly. There is no second
copy of the weights, so what the optimizer wrote is what generation uses, and
`update_weights` has nothing to do. `HFRollout.from_pretrained` builds an engine with a
model of its own instead; then `update_weights` copies the trained tensors into it.

Each `generate` call pins every sampling knob in an explicit GenerationConfig and hides
the checkpoint's `generation_config` for the duration: transformers otherwise fills any
unset field from it (a checkpoint's top_k=20 or repetition_penalty=1.1 would silently
change the rollout policy).

Log-probs are log_softmax(raw_logits / temperature) of the sampled tokens (see
`ember.inference.sampling`), recorded while `generate` runs by `SampledTokenLogProbs`, a
logits processor that keeps one step's (rows, vocab) logits at a time; `generate` is not
asked to return logits, so memory does not grow with the number of steps.

An FSDP2-wrapped module is gathered once for the whole `generate` call and resharded after
(see `gathered_for_generation`): otherwise every decode step would all-gather and cast each
layer's weights again. With FSDP mixed precision, generation then runs in `param_dtype`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from ember.distributed.device import empty_cache
from ember.inference.sampling import log_prob_temperature, token_log_probs
from ember.models.weight_copy import copy_named_tensors
from ember.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from ember.rollout.sampling import trim_response


class HFRollout(RolloutEngine):
    """Rollout engine on transformers' `generate`; by default shares the training module's weights."""

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        max_batch_size: int = 1024,
        dtype: torch.dtype | None = None,
        owns_model: bool = False,
    ) -> None:
        """
        model: a transformers causal LM (anything with `.generate`), possibly wrapped by FSDP2.
        pad_token_id: id used to left-pad prompts and fill finished rows; never part of a response.
        max_batch_size: most rows (prompts x n) per `generate` call; bounds KV-cache and per-step logits
            memory (rollout.max_num_seqs in the config).
        dtype: if set, generation runs under torch.autocast to this dtype (e.g. bfloat16 for an
            fp32 module); None generates in the module's own dtype.
        owns_model: False (hybrid engine): the module is the training engine's, `update_weights`
            is a no-op and `sleep`/`wake` leave its memory to the training engine. True: the
            engine holds its own copy, which `update_weights` overwrites and `sleep` moves to CPU.
        """
        if not callable(getattr(model, "generate", None)):
            raise TypeError(
                f"HFRollout needs a transformers causal LM with .generate (e.g. from "
                f"AutoModelForCausalLM); got {type(model).__name__}"
            )
        if pad_token_id < 0:
            raise ValueError(f"pad_token_id={pad_token_id}: pass the tokenizer's pad id (a token id >= 0)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: set it to at least 1 row per generate call")
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.dtype = dtype
        self.owns_model = owns_model
        self._device = next(model.parameters()).device
        self._asleep = False

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        pad_token_id: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        max_batch_size: int = 1024,
    ) -> HFRollout:
        """An engine with its own model loaded from a HF checkpoint in `dtype` on `device`."""
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, pad_token_id, max_batch_size=max_batch_size, owns_model=True)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 injections=None) -> list[RolloutOutput]:
        """Sample `sampling.n` responses per prompt, grouped by prompt, with rollout log-probs.

        The same seed gives the same samples for the same prompts and max_batch_size (rows
        are drawn chunk by chunk). A seeded call leaves the global RNG state as it found it.
        NLA injections are refused: generating with them is ember's engine's (rollout.name=ember).
        """
        if injections is not None and any(injection is not None for injection in injections):
            raise ValueError("the hf rollout cannot inject NLA vectors; use rollout.name=ember (or nla_sglang)")
        if self._asleep:
            raise RuntimeError("HFRollout.generate called while asleep: call wake() first")
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(
                    f"prompt {index} is empty: every prompt needs at least one token (e.g. BOS)"
                )
        rows = [prompt for prompt in prompts for _ in range(sampling.n)]
        generation_config = build_generation_config(sampling, self.pad_token_id)
        temperature = log_prob_temperature(sampling)
        generated: list[tuple[list[int], list[float]]] = []
        with self._generation_mode(), gathered_for_generation(self.model), _seeded(sampling.seed, self._device):
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start : start + self.max_batch_size]
                generated += self._generate_chunk(chunk, generation_config, temperature)
        outputs = []
        for row, (token_ids, log_probs) in enumerate(generated):
            response, finish_reason = trim_response(token_ids, sampling.stop_token_ids, sampling.ignore_eos)
            outputs.append(
                RolloutOutput(
                    prompt_index=row // sampling.n,
                    token_ids=response,
                    log_probs=log_probs[: len(response)],
                    finish_reason=finish_reason,
                )
            )
        return outputs

    def _generate_chunk(
        self, prompts: list[list[int]], generation_config: GenerationConfig, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """Generated tokens (untrimmed, padding included) and their log-probs at `temperature`, per prompt."""
        input_ids, attention_mask = left_pad(prompts, self.pad_token_id, self._device)
        recorder = SampledTokenLogProbs(prompt_width=input_ids.shape[1], temperature=temperature)
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=LogitsProcessorList([recorder]),
        )
        log_probs = recorder.finish(sequences)
        new_tokens = sequences[:, input_ids.shape[1] :]
        return list(zip(new_tokens.tolist(), log_probs.tolist()))

    @contextmanager
    def _generation_mode(self) -> Iterator[None]:
        """Eval mode, no grad, autocast if asked, checkpoint generation defaults hidden; restored after."""
        was_training = self.model.training
        checkpoint_generation_config = self.model.generation_config
        self.model.eval()
        # transformers fills unset GenerationConfig fields from model.generation_config: hide it.
        self.model.generation_config = GenerationConfig()
        device_type = self._device.type
        autocast = nullcontext() if self.dtype is None else torch.autocast(device_type, dtype=self.dtype)
        try:
            with torch.no_grad(), autocast:
                yield
        finally:
            self.model.generation_config = checkpoint_generation_config
            self.model.train(was_training)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy trained tensors in place into an owned model; a no-op when sharing the training module.

        With a shared module the training engine's optimizer already wrote the weights that
        generation reads, so `named_tensors` is not consumed.
        """
        if not self.owns_model:
            return
        copy_named_tensors(self.model.state_dict(), named_tensors, owner="the rollout model")

    @property
    def shares_training_weights(self) -> bool:
        return not self.owns_model

    def sleep(self) -> None:
        """Refuse generation until `wake`; an owned model also moves to CPU and frees accelerator cache."""
        self._asleep = True
        if self.owns_model:
            self.model.to("cpu")
            empty_cache()

    def wake(self) -> None:
        """Allow generation again; an owned model moves back to its device."""
        if self.owns_model:
            self.model.to(self._device)
        self._asleep = False


class SampledTokenLogProbs(LogitsProcessor):
    """A logits processor that records log_softmax(scores / temperature) of each sampled token.

    `generate` calls its logits processors once per step with the sequence so far and the
    float32 next-token scores, and samples after them. The token sampled at step t is thus
    known only at step t + 1 (the last column of `input_ids`); until then the processor
    keeps step t's scores, one (rows, vocab) tensor, and it gathers the last step's token
    in `finish` from the returned sequences. Memory stays that of one step's logits.

    What the scores are: transformers (5.x, `GenerationMixin._get_logits_processor`) runs
    the processors it builds from the GenerationConfig first, then the ones passed in
    `logits_processor=`, then the sampling warpers (temperature, top-k, top-p). The
    GenerationConfig of `build_generation_config` builds none (no repetition penalty, no
    minimum length, no suppressed or forced tokens), so the scores seen here are the raw
    last-position logits cast to float32, and the warpers do not touch what is recorded.
    A copy is kept because a processor after this one may modify the scores in place.
    """

    def __init__(self, prompt_width: int, temperature: float) -> None:
        """prompt_width: columns of the (left-padded) prompt batch; temperature: divides the logits."""
        self.prompt_width = prompt_width
        self.temperature = temperature
        self._pending_logits: Tensor | None = None
        self._log_probs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """Gather the previous step's sampled token, keep this step's scores; returns `scores` unchanged."""
        if self._pending_logits is not None:
            self._log_probs.append(token_log_probs(self._pending_logits, input_ids[:, -1], self.temperature))
        if input_ids.shape[1] - self.prompt_width != len(self._log_probs):
            raise RuntimeError(
                f"SampledTokenLogProbs saw a sequence of {input_ids.shape[1]} columns after recording "
                f"{len(self._log_probs)} tokens of a {self.prompt_width}-column prompt: generate must call it "
                "once per generated token (plain sampling or greedy decoding, one return sequence per row)"
            )
        self._pending_logits = scores.clone()
        return scores

    def finish(self, sequences: Tensor) -> Tensor:
        """(rows, new tokens) float32 log-probs of the tokens `generate` returned after the prompt.

        A generate that ran one step past its stop and dropped it (transformers defers the stop
        check on some devices) leaves a record too many; records beyond the returned tokens are cut.
        """
        new_tokens = sequences[:, self.prompt_width :]
        steps = new_tokens.shape[1]
        if len(self._log_probs) < steps:
            self._log_probs.append(token_log_probs(self._pending_logits, new_tokens[:, steps - 1], self.temperature))
        self._pending_logits = None
        return torch.stack(self._log_probs[:steps], dim=1)


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Keep an FSDP2 module's parameters gathered for a whole `generate` call; nothing for other modules.

    FSDP2 with reshard_after_forward=True frees each layer's gathered (and mixed-precision
    cast) weights after every forward, i.e. after every decode step, and gathers them again
    for the next one. Inside this context the reshard setting is off and every FSDP module
    is unsharded once; on exit each module gets its previous setting back and is resharded,
    so training finds the module as it left it.
    """
    if not isinstance(model, FSDPModule):
        yield
        return
    fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    settings = [_reshards_after_forward(module, is_root=module is model) for module in fsdp_modules]
    model.set_reshard_after_forward(False, recurse=True)
    try:
        for module in fsdp_modules:
            module.unshard()
        yield
    finally:
        for module, reshards in zip(fsdp_modules, settings):
            module.set_reshard_after_forward(reshards, recurse=False)
            module.reshard()


def _reshards_after_forward(module: FSDPModule, is_root: bool) -> bool:
    """Whether FSDP frees `module`'s gathered parameters after its forward.

    torch (2.11 to 2.13) has a setter for this but no getter, so it is read from FSDP's state.
    A root sharded with fully_shard's default (reshard_after_forward=None) stays gathered.
    """
    state = module._get_fsdp_state()
    param_group = state._fsdp_param_group
    if param_group is None:  # the module manages no parameters of its own
        return False
    if is_root and state._auto_reshard_after_forward:
        return False
    return param_group.post_forward_mesh_info is not None


def build_generation_config(sampling: SamplingParams, pad_token_id: int) -> GenerationConfig:
    """A GenerationConfig with every field that shapes the sampled tokens set explicitly.

    Greedy decoding leaves temperature/top-k/top-p out: transformers applies them only when
    sampling, and warns when they are set without it.
    """
    if sampling.greedy:
        strategy = {"do_sample": False}
    else:
        strategy = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k if sampling.top_k_enabled else 0,  # unset would mean transformers' 50
            "top_p": sampling.top_p,
        }
    return GenerationConfig(
        **strategy,
        max_new_tokens=sampling.max_new_tokens,
        min_length=0,  # min_new_tokens=0 would set min_length to the prompt width: a no-op processor
        eos_token_id=[] if sampling.ignore_eos else list(sampling.stop_token_ids),
        pad_token_id=pad_token_id,
        repetition_penalty=1.0,
        num_beams=1,
        num_return_sequences=1,
        use_cache=True,  # a training module may have config.use_cache=False for gradient checkpointing
        return_dict_in_generate=False,  # only the sequences: SampledTokenLogProbs records the log-probs
    )


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Left-pad prompts to one width: (input_ids, attention_mask), both (rows, width) on `device`."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed the RNGs that sampling on `device` draws from, restoring their previous state after."""
    if seed is None:
        yield
        return
    if device.type == "cpu":
        forked = torch.random.fork_rng(devices=[])
    else:
        index = device.index if device.index is not None else torch.accelerator.current_device_index()
        forked = torch.random.fork_rng(devices=[index], device_type=device.type)
    with forked:
        torch.manual_seed(seed)
        yield
