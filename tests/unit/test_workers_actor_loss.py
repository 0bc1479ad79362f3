"""The actor's backpropagated loss: policy loss + KL loss − entropy bonus, each with its sign and
coefficient, normalised by the mini-batch's global token count. The logged `kl_loss` and
`entropy` metrics are computed apart from this loss, so the loss and its gradient are checked here."""

import math

import pytest
import torch

from ember.algorithms import (LOSS_AGG_MODES, BypassCorrection, ClipConfig, PolicyLossInputs, aggregate_loss,
                              get_policy_loss_fn)
from ember.data.batch import Batch
from ember.engines.base import LossContext, MicroBatchSpec, ModelOutput
from ember.workers.actor import Actor, ActorOptions

KL_COEF = 0.3
ENTROPY_COEF = 0.05


NORM_LENGTH = 7  # seq-mean-token-sum-norm's divisor: wider than the micro-batch's 4 response positions
CLIP = ClipConfig(clip_ratio=0.2)


def actor(kl_loss_type: str, entropy_coeff: float = ENTROPY_COEF, loss_agg_mode: str = "token-mean",
          bypass: BypassCorrection | None = None, use_kl_loss: bool = True) -> Actor:
    """An actor whose loss is called directly: no engine is needed for `_loss`."""
    return Actor(engine=None, options=ActorOptions(
        mini_batch_samples=3, micro_batch=MicroBatchSpec(size=3), log_prob_micro_batch=MicroBatchSpec(size=3),
        ppo_epochs=1, shuffle=False, policy_loss="vanilla", clip=CLIP, loss_agg_mode=loss_agg_mode,
        entropy_coeff=entropy_coeff, use_kl_loss=use_kl_loss, kl_loss_coef=KL_COEF, kl_loss_type=kl_loss_type,
        temperature=1.0, norm_length=NORM_LENGTH, seed=0, bypass=bypass))


def batch_and_output() -> tuple[Batch, ModelOutput]:
    """Three responses of 4, 2 and 3 tokens; log-probs and entropies as leaves that collect gradients.
    Old log-probs are absent, so every ratio is 1 and each token's policy loss is −A."""
    generator = torch.Generator().manual_seed(0)
    batch = Batch.from_rollout([[5, 6], [7], [8, 9, 10]], [[11, 12, 13, 14], [15, 16], [17, 18, 19]], pad_token_id=0)
    shape = batch.response_mask.shape
    mask = batch.response_mask
    batch = batch.with_fields(advantages=torch.randn(shape, generator=generator) * mask,
                              ref_log_probs=-torch.rand(shape, generator=generator) * 3 * mask)
    output = ModelOutput(log_probs=(-torch.rand(shape, generator=generator) * 3).requires_grad_(),
                         entropy=(torch.rand(shape, generator=generator) * 2).requires_grad_())
    return batch, output


def test_the_loss_adds_the_kl_term_and_subtracts_the_entropy_bonus():
    batch, output = batch_and_output()
    mask = batch.response_mask.bool()
    num_tokens = 2 * int(mask.sum())  # this micro-batch holds half of the mini-batch's tokens
    loss, metrics = actor("k1")._loss(output, batch, LossContext(num_tokens=num_tokens, num_sequences=6, dp_size=1))

    advantages, kl = batch.advantages[mask], (output.log_probs - batch.ref_log_probs)[mask].detach()
    entropy = output.entropy[mask].detach()
    expected = (-advantages.sum() + KL_COEF * kl.sum() - ENTROPY_COEF * entropy.sum()) / num_tokens
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["kl_loss"].item() == pytest.approx(kl.mean().item(), rel=1e-6)  # the metric is the local mean

    loss.backward()
    zero = torch.zeros_like(batch.advantages)
    torch.testing.assert_close(output.log_probs.grad, torch.where(mask, (-batch.advantages + KL_COEF) / num_tokens, zero))
    torch.testing.assert_close(output.entropy.grad, torch.where(mask, zero - ENTROPY_COEF / num_tokens, zero))


@pytest.mark.parametrize("kl_loss_type", ["low_var_kl", "k2", "abs"])
def test_a_gradient_step_on_the_kl_loss_moves_log_probs_toward_the_reference(kl_loss_type):
    batch, output = batch_and_output()
    batch = batch.with_fields(advantages=torch.zeros_like(batch.advantages))  # the KL term alone
    mask = batch.response_mask.bool()
    loss, _ = actor(kl_loss_type, entropy_coeff=0.0)._loss(
        output, batch, LossContext(num_tokens=int(mask.sum()), num_sequences=3, dp_size=1))
    loss.backward()
    gap = (output.log_probs - batch.ref_log_probs).detach()
    assert (gap[mask] != 0).all()
    assert (output.log_probs.grad[mask] * gap[mask] > 0).all()  # descending the gradient shrinks |log π − log π_ref|
    assert (output.log_probs.grad[~mask] == 0).all()


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_the_loss_shares_and_metrics_follow_the_mode_the_global_counts_and_the_old_log_probs(loss_agg_mode):
    """The backpropagated loss is this micro-batch's share under the mini-batch's global counts and
    `norm_length`, with the batch's old log-probs in the ratio; the metrics are normalised locally."""
    batch, output = batch_and_output()
    mask = batch.response_mask
    generator = torch.Generator().manual_seed(1)
    noise = 0.3 * torch.randn(mask.shape, generator=generator)
    batch = batch.with_fields(old_log_probs=(output.log_probs.detach() + noise) * mask)
    context = LossContext(num_tokens=2 * int(mask.sum()), num_sequences=6, dp_size=1)
    loss, metrics = actor("k1", loss_agg_mode=loss_agg_mode)._loss(output, batch, context)

    shares = dict(num_tokens=context.num_tokens, num_sequences=context.num_sequences, norm_length=NORM_LENGTH)
    log_probs, entropy = output.log_probs.detach(), output.entropy.detach()
    inputs = PolicyLossInputs(old_log_probs=batch.old_log_probs, log_probs=log_probs, advantages=batch.advantages,
                              response_mask=mask)
    kl = log_probs - batch.ref_log_probs
    policy = get_policy_loss_fn("vanilla")(inputs, CLIP, loss_agg_mode=loss_agg_mode, **shares)
    expected = (policy.loss + KL_COEF * aggregate_loss(kl, mask=mask, mode=loss_agg_mode, **shares)
                - ENTROPY_COEF * aggregate_loss(entropy, mask=mask, mode=loss_agg_mode, **shares))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert policy.ppo_kl.abs() > 0.01  # the old log-probs are not the current ones

    local = get_policy_loss_fn("vanilla")(inputs, CLIP, loss_agg_mode=loss_agg_mode, norm_length=NORM_LENGTH)
    expected_metrics = {
        "pg_loss": local.loss, "pg_clipfrac": local.clipfrac, "ppo_kl": local.ppo_kl,
        "pg_clipfrac_lower": local.clipfrac_lower,
        "entropy": aggregate_loss(entropy, mask=mask, mode=loss_agg_mode, norm_length=NORM_LENGTH),
        "kl_loss": aggregate_loss(kl, mask=mask, mode=loss_agg_mode, norm_length=NORM_LENGTH), "kl_coef": KL_COEF}
    assert metrics.keys() == expected_metrics.keys()
    for key, value in expected_metrics.items():
        assert float(metrics[key]) == pytest.approx(float(value), rel=1e-6), key



def test_bypass_reinforce_weights_each_tokens_gradient_by_current_over_rollout_and_drops_rejected_samples():
    """verl's bypass mode with loss_type=reinforce: the loss is −A·w·log π with w = π_θ/π_rollout
    (truncated at 1.5, detached) from this forward, and a sample that a rejection rule refuses adds nothing."""
    batch, output = batch_and_output()
    mask = batch.response_mask.bool()
    lag = torch.tensor([[0.3, -0.2, 0.9, 0.0], [0.1, 0.0, 0.0, 0.0], [-0.05, 0.05, 0.02, 0.0]])  # log π_θ − log π_rollout
    rollout = (output.log_probs.detach() - lag) * mask
    batch = batch.with_fields(rollout_log_probs=rollout, old_log_probs=rollout)  # bypass: old = rollout
    bypass = BypassCorrection(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5,
                              rollout_is_batch_normalize=False, rejection={"seq_max_k2": (None, 0.2)})
    num_tokens = int(mask.sum())
    loss, metrics = actor("k1", entropy_coeff=0.0, bypass=bypass, use_kl_loss=False)._loss(
        output, batch, LossContext(num_tokens=num_tokens, num_sequences=3, dp_size=1))
    loss.backward()
    weights = torch.exp(lag).clamp(max=1.5)
    kept = torch.tensor([[0.0], [1.0], [1.0]])  # ½·0.9² = 0.405 > 0.2 rejects the first sample
    expected = torch.where(mask, -batch.advantages * weights * kept / num_tokens, torch.zeros_like(lag))
    torch.testing.assert_close(output.log_probs.grad, expected)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.9), rel=1e-5)  # before truncation
