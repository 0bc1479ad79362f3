"""Checks of ember's Triton kernels under Triton's interpreter, each against the PyTorch path it replaces, float32
on the CPU. `test_triton_kernels.py` runs this file in a process started with TRITON_INTERPRET=1 (Triton decorates
its own library functions at import, so the switch must be on before anything imports Triton) and reads one line
of JSON: each check's name and "ok" or its traceback.

Under the interpreter the sampler's `libdevice.fast_logf` (the hardware's approximate logarithm, which the
interpreter cannot run) is `tl.log`; tensors are float32 (the interpreter's bf16 rounding is not the GPU's)."""

from __future__ import annotations

import json
import os
import traceback
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def check_sampling_whole_and_from_vocabulary_parts() -> None:
    from ember.inference.hashing import gumbel_noise, row_keys
    from ember.inference.kernels import sample as kernels

    torch.manual_seed(0)
    rows, vocab = 5, 9001  # two chunks of 8192, the second mostly outside the vocabulary
    logits = torch.randn(rows, vocab) * 3
    seeds, positions = torch.randint(0, 1 << 31, (rows,)), torch.randint(0, 500, (rows,))
    noise = gumbel_noise(row_keys(seeds, positions), vocab)
    tokens, log_probs = kernels.fused_sample(logits, logits, seeds, positions, 1 / 0.7, 0.7)
    assert torch.equal(tokens, (logits / 0.7 + noise).argmax(-1)), tokens
    torch.testing.assert_close(log_probs, torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:, 0],
                               atol=1e-5, rtol=0)
    greedy, greedy_log_probs = kernels.fused_sample(logits, logits, None, None, 1.0, 1.0)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(greedy_log_probs, torch.log_softmax(logits, -1).max(-1).values, atol=1e-5, rtol=0)
    tied = torch.zeros(2, vocab)
    tied[:, [100, 8500]] = 1.0  # equal best entries in two chunks: the earlier one, as one pass over the row
    assert kernels.fused_sample(tied, tied, None, None, 1.0, 1.0)[0].tolist() == [100, 100]
    # scores apart from the logits (a truncated draw): the argmax of the scores, the log-prob of the logits
    truncated = logits.masked_fill(logits < logits.quantile(0.9, dim=-1, keepdim=True), float("-inf"))
    drawn, drawn_log_probs = kernels.fused_sample(truncated, logits, seeds, positions, 1.0, 1.0)
    assert torch.equal(drawn, (truncated + noise).argmax(-1)), drawn
    torch.testing.assert_close(drawn_log_probs, torch.log_softmax(logits, -1).gather(1, drawn[:, None])[:, 0],
                               atol=1e-5, rtol=0)

    # rollout TP: each rank's rows of the vocabulary (the last one padded), partials side by side, one combine
    assert_parts_draw_the_whole(kernels, logits, seeds, positions, tokens, log_probs, ranks=2)
    # a vocabulary one entry past a chunk: the last rank's second chunk is all padding (its sum must be 0, not NaN)
    logits = torch.randn(rows, 16385) * 3
    assert_parts_draw_the_whole(kernels, logits, seeds, positions, *kernels.fused_sample(logits, logits, seeds, positions,
                                                                                    1 / 0.7, 0.7), ranks=2)
    # a vocabulary short of the last rank (9 over 4 ranks of 3 rows): that rank holds padding only
    logits = torch.randn(rows, 9) * 3
    assert_parts_draw_the_whole(kernels, logits, seeds, positions, *kernels.fused_sample(logits, logits, seeds, positions,
                                                                                    1 / 0.7, 0.7), ranks=4)


def assert_parts_draw_the_whole(kernels, logits, seeds, positions, tokens, log_probs, ranks: int) -> None:
    """The draw from `ranks` ranks' rows of the vocabulary (padded to equal rows, padding never drawn), kernel
    partials and PyTorch partials alike, is the whole vocabulary's draw (`tokens`, `log_probs`)."""
    from ember.inference.sampling import tokens_from_partials, vocab_partials
    from ember.rollout.base import SamplingParams

    vocab = logits.shape[1]
    width = -(-vocab // ranks)
    padded = F.pad(logits, (0, ranks * width - vocab), value=50.0)  # the padding must never be drawn
    parts = [(padded[:, first:first + width], first, max(0, min(width, vocab - first)))
             for first in range(0, ranks * width, width)]
    partials = torch.cat([kernels.sample_partials(part, part, seeds, positions, 1 / 0.7, 0.7, first, columns)
                          for part, first, columns in parts], dim=-1)
    combined = kernels.combine_partials(partials)
    assert torch.equal(combined[0], tokens), (combined[0], tokens)
    torch.testing.assert_close(combined[1], log_probs, atol=1e-6, rtol=0)
    sampling = SamplingParams(temperature=0.7)
    reference = tokens_from_partials(torch.cat([vocab_partials(part, sampling, seeds, positions, first, columns)
                                                for part, first, columns in parts], dim=-1))
    assert torch.equal(reference[0], tokens), (reference[0], tokens)
    torch.testing.assert_close(reference[1], log_probs, atol=1e-5, rtol=0)


def check_nucleus_threshold_cuts_as_the_sorted_row() -> None:
    from ember.inference.kernels.nucleus import nucleus_threshold
    from ember.inference.sampling import kept_threshold

    torch.manual_seed(0)
    for scale in (0.5, 3.0, 10.0):
        rows = torch.randn(6, 9001) * scale  # two chunks of 8192, the second mostly outside the vocabulary
        rows[0, :100] = float("-inf")  # cut already (a top-k before)
        rows[1] = rows[1].round()  # wide ties: the cut keeps the whole group of its least kept value
        rows[2, ::4], rows[2, 2::4] = -0.0, 0.0  # -0.0 and +0.0 are one value
        rows[3, 5] = rows[3].max() + 30  # one token holds almost all the mass: it alone stays
        for top_p in (0.3, 0.6, 0.9, 0.99):  # (near 1 the cut falls within the sums' rounding, module docstring)
            got, want = nucleus_threshold(rows, top_p), kept_threshold(rows, -1, top_p)
            assert torch.equal(rows < got, rows < want), (scale, top_p, got[:, 0], want[:, 0])
    assert (nucleus_threshold(rows, 0.9)[3] == rows[3, 5]).all()


def check_norm_and_swiglu() -> None:
    from ember.inference.kernels import norm_act as kernels
    from ember.inference.models.layers import _rms_norm

    torch.manual_seed(0)
    states, residual = torch.randn(7, 576), torch.randn(7, 576)  # neither a power of two nor a block multiple
    weight = 1 + 0.1 * torch.randn(576)
    normed, summed = kernels.rms_norm(states, weight, 1e-5)
    assert summed is None
    torch.testing.assert_close(normed, _rms_norm(states, weight, 1e-5), atol=1e-5, rtol=1e-5)
    normed, summed = kernels.rms_norm(states, weight, 1e-5, residual=residual)
    assert torch.equal(summed, states + residual)
    torch.testing.assert_close(normed, _rms_norm(states + residual, weight, 1e-5), atol=1e-5, rtol=1e-5)
    gate, up = torch.randn(7, 2 * 1216).chunk(2, dim=-1)  # strided halves, as the fused projection gives them
    torch.testing.assert_close(kernels.silu_and_mul(gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def check_paged_decode() -> None:
    from ember.inference.attention import AttentionInputs, gathered_attention
    from ember.inference.kernels.paged_decode import paged_decode_attention

    torch.manual_seed(0)
    blocks, block_size, kv_heads, head_dim, heads, rows = 24, 16, 2, 32, 6, 5
    key_cache = torch.randn(blocks, block_size, kv_heads, head_dim)
    value_cache = torch.randn_like(key_cache)
    context = torch.tensor([1, 16, 17, 64, 130])  # one token, a whole block, a block and one, a tile, three tiles
    tables = torch.stack([torch.randperm(blocks)[:9] for _ in range(rows)])
    queries = torch.randn(rows, heads, head_dim)
    inputs = AttentionInputs(slot_mapping=torch.zeros(rows, dtype=torch.long),
                             query_lengths=torch.ones(rows, dtype=torch.long), context_lengths=context,
                             block_tables=tables, block_size=block_size, is_decode=True)
    for window in (None, 24):
        expected = gathered_attention(queries, key_cache, value_cache, inputs, head_dim**-0.5, window)
        actual = paged_decode_attention(queries, key_cache, value_cache, tables, context, head_dim**-0.5, window)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"window {window}")


def check_rope_cache() -> None:
    from ember.inference.attention import write_kv_cache
    from ember.inference.kernels.rope_cache import rope_and_cache
    from ember.inference.models.rope import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, head_dim, tokens = 6, 2, 32, 20
    rotary = RotaryEmbedding(head_dim, 512, {"rope_theta": 1000000.0})
    rotary.reset_tables()
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)  # strided q/k/v views of one projection
    queries, keys, values = (part.unflatten(-1, (-1, head_dim))
                             for part in fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))
    positions, slots = torch.randint(0, 512, (tokens,)), torch.randperm(8 * 16)[:tokens]
    caches = [torch.zeros(8, 16, kv_heads, head_dim) for _ in range(4)]
    rotated = rope_and_cache(queries, keys, values, rotary.cos, rotary.sin, positions, caches[0], caches[1], slots)
    expected_queries, expected_keys = rotary(positions, queries, keys)
    write_kv_cache(expected_keys, values, caches[2], caches[3], slots)
    torch.testing.assert_close(rotated, expected_queries, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[0], caches[2], atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[1], caches[3])


def fused_log_probs_and_grads(hidden, weight, targets, kernels: bool, entropy_grad: bool):
    """The fused log-prob path's outputs and both gradients, on its Triton kernels or on its PyTorch path."""
    from ember.engines import fused_log_probs as fused

    uses_kernels = fused._uses_kernels
    fused._uses_kernels = lambda tensor: kernels
    try:
        hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        log_probs, entropy = fused.fused_log_probs(hidden, weight, targets, temperature=0.8, compute_entropy=True,
                                                   entropy_grad=entropy_grad, chunk_size=16)
        loss = (log_probs * torch.linspace(-1, 1, len(targets))).sum()
        if entropy_grad:
            loss = loss + 0.3 * entropy.sum()
        loss.backward()
    finally:
        fused._uses_kernels = uses_kernels
    return log_probs, entropy, hidden.grad, weight.grad


def check_log_probs_and_gradients() -> None:
    torch.manual_seed(0)
    tokens, hidden_size, vocab = 40, 24, 5000  # two blocks of 4096 a row, the second partly outside
    hidden = torch.randn(tokens, hidden_size)
    weight = torch.randn(vocab, hidden_size) * hidden_size**-0.5 * 4
    targets = torch.randint(0, vocab, (tokens, 3))[:, 1]  # a strided view, as the padded path's can be
    for entropy_grad in (False, True):
        expected = fused_log_probs_and_grads(hidden, weight, targets, False, entropy_grad)
        actual = fused_log_probs_and_grads(hidden, weight, targets, True, entropy_grad)
        for name, got, want in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), actual, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"{name}, entropy_grad={entropy_grad}")


@triton.jit
def natural_log(values):
    return tl.log(values)


CHECKS = {name: check for name, check in globals().items() if name.startswith("check_")}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1: Triton must be imported under it")
    from triton.runtime import interpreter

    from ember.inference.kernels import sample

    patch_tensor = interpreter._patch_lang_tensor

    def index_of_one_element(tensor, scope):
        """The interpreter reads a kernel's integer argument (`range(0, vocab, BLOCK)`) as `int()` of an array of
        one element, which numpy 2 refuses: read its item."""
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = index_of_one_element
    sample.libdevice = SimpleNamespace(fast_logf=natural_log)
    results = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # each check reports on its own
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
