"""Adaptive noise injection (AQN, `trainer.noise_injection`): Gaussian noise on the rollout's copy of
chosen weights, annealed over the run, to make sampling explore; the actor's weights never change.

As users run it today (a public verl fork, after the QeRL paper), with ember's changes where the
fork goes silently wrong:

- Schedule: N−1 values geometric from `sigma_start` to `sigma_end`, trend[i] = σs·(σe/σs)^(i/(N−2));
  with T the run's total steps (ember's real count: `trainer.total_training_steps`, else epochs ×
  batches per epoch) and k = ⌊step / (T/N)⌋, σ = 0 in the first N-th of the run (k = 0), else
  trend[min(k−1, N−2)]. N = 2 (a division by zero in the fork) means one noisy stage at
  `sigma_start`; N ≤ 1 means no noise. σ is a function of the step, so a resumed run continues it.
- Selection: a module is noised when its type is one of `layer_types` (`rmsnorm`: RMSNorm
  classes; `linear`: 2-D Linear weights), no `exclude_patterns` entry is part of its name
  (checked first) and some `target_modules` entry is. A string is read as JSON (the fork splits it
  into characters, which then match almost every name). A selection of nothing stops the run at
  start, naming what the patterns would select with `linear` added (the fork noises 0 modules
  and runs plain GRPO without a word).
- Noise: w + N(0, σ), drawn in fp32 on the tensor's device from a generator seeded by (run seed,
  step, tensor), cast back; applied to the weight stream on its way to the rollout engine, never
  in place, fresh at every sync, never accumulating. Validation generates with clean weights (the
  fork noises it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ember.errors import UserError


def sigma_at(step: int, total_steps: int, sigma_start: float, sigma_end: float, num_stages: int) -> float:
    """The noise standard deviation at `step` (see the module docstring)."""
    if num_stages <= 1 or total_steps <= 0:
        return 0.0
    stage = int(step // (total_steps / num_stages))
    if stage == 0:
        return 0.0
    if num_stages == 2:
        return sigma_start
    last = num_stages - 2
    index = min(stage - 1, last)
    return sigma_start * (sigma_end / sigma_start) ** (index / last)


def pattern_list(value, key: str) -> list[str]:
    """A list of patterns as given, with any entry that is a JSON list in a string read as that list
    (what `target_modules='["experts","mlp"]'` arrives as)."""
    items = value if isinstance(value, list) else [value]
    patterns = []
    for item in items:
        if isinstance(item, str) and item.strip().startswith("["):
            try:
                item = json.loads(item)
            except json.JSONDecodeError:
                raise UserError(f"{key}={value!r}: {item!r} looks like a JSON list but does not parse; write "
                                "a list of name patterns") from None
        patterns += item if isinstance(item, list) else [item]
    if not all(isinstance(pattern, str) for pattern in patterns):
        raise UserError(f"{key}={value!r}: give a list of name patterns (or a JSON list in a string)")
    return patterns


def _type_matches(module: nn.Module, layer_types: list[str]) -> bool:
    kinds = {kind.lower() for kind in layer_types}
    name = type(module).__name__.lower()
    if "rmsnorm" in kinds and "rmsnorm" in name:
        return True
    return "linear" in kinds and isinstance(module, nn.Linear) and module.weight.dim() == 2


def select_weights(model: nn.Module, targets: list[str], excludes: list[str], layer_types: list[str]) -> dict[str, int]:
    """{parameter name: elements} of the weights the patterns select in `model` (HF names)."""
    selected = {}
    for name, module in model.named_modules():
        if not name or getattr(module, "weight", None) is None or not _type_matches(module, layer_types):
            continue
        if any(pattern in name for pattern in excludes):
            continue
        if any(pattern in name for pattern in targets):
            selected[f"{name}.weight"] = module.weight.numel()
    return selected


@dataclass(frozen=True)
class NoiseInjection:
    """The run's noise: which weights, how much at which step, and its seed."""

    weights: dict[str, int]  # HF parameter name -> elements
    total_steps: int
    sigma_start: float
    sigma_end: float
    num_stages: int
    seed: int

    def sigma(self, step: int) -> float:
        return sigma_at(step, self.total_steps, self.sigma_start, self.sigma_end, self.num_stages)

    def metrics(self, step: int) -> dict[str, float]:
        sigma = self.sigma(step)
        noised = sigma > 0
        return {"noise/sigma": sigma, "noise/tensors": float(len(self.weights) if noised else 0),
                "noise/elements": float(sum(self.weights.values()) if noised else 0)}

    def apply(self, bucket: list[tuple[str, Tensor]], step: int) -> list[tuple[str, Tensor]]:
        """`bucket` with noise added to the selected weights, as new tensors (never in place)."""
        sigma = self.sigma(step)
        if sigma == 0:
            return bucket
        noisy = []
        for name, tensor in bucket:
            if name in self.weights:
                generator = torch.Generator(device=tensor.device).manual_seed(self._tensor_seed(step, name))
                noise = torch.randn(tensor.shape, generator=generator, device=tensor.device, dtype=torch.float32)
                tensor = (tensor.float() + sigma * noise).to(tensor.dtype)
            noisy.append((name, tensor))
        return noisy

    def _tensor_seed(self, step: int, name: str) -> int:
        digest = sum((index + 1) * ord(character) for index, character in enumerate(name))
        return (self.seed * 1_000_003 + step * 7919 + digest) % (1 << 63)


def build_noise_injection(options, model: nn.Module, total_steps: int, seed: int) -> NoiseInjection | None:
    """The run's NoiseInjection from `trainer.noise_injection` and the actor's model (its module
    names and types, HF naming); None when it is off. An empty selection is a UserError."""
    if not options.enabled:
        return None
    key = "trainer.noise_injection"
    targets = pattern_list(options.target_modules, f"{key}.target_modules")
    excludes = pattern_list(options.exclude_patterns, f"{key}.exclude_patterns")
    layer_types = pattern_list(options.layer_types, f"{key}.layer_types")
    weights = select_weights(model, targets, excludes, layer_types)
    if not weights:
        with_linear = select_weights(model, targets, excludes, sorted({*layer_types, "linear"}))
        raise UserError(
            f"{key} selects no weight of this model: target_modules={targets}, exclude_patterns={excludes}, "
            f"layer_types={layer_types} (its RMSNorms are named like "
            f"{sorted({name.rsplit('.', 1)[-1] for name, module in model.named_modules() if 'rmsnorm' in type(module).__name__.lower()})}). "
            f"With layer_types including linear they would select {len(with_linear)} tensors "
            f"({sum(with_linear.values())} elements). Change target_modules or layer_types, or turn noise off")
    return NoiseInjection(weights, total_steps, options.sigma_start, options.sigma_end, options.num_stages, seed)
