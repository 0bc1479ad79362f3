"""copy_named_tensors: named full tensors copied in place, batched, cast, and never held whole."""

import pytest
import torch

import ember.models.weight_copy as weight_copy
from ember.models.weight_copy import copy_named_tensors


def test_copies_in_place_casting_to_each_target_dtype_and_names_what_it_wrote():
    fused = torch.zeros(6, 3, dtype=torch.bfloat16)
    targets = {"a": torch.zeros(4), "q": fused[:2], "k": fused[2:6]}
    sources = {"a": torch.randn(4, dtype=torch.float64), "q": torch.randn(2, 3), "k": torch.randn(4, 3)}
    address = targets["a"].data_ptr()
    assert copy_named_tensors(targets, sources.items(), owner="the test model") == {"a", "q", "k"}
    assert targets["a"].data_ptr() == address and targets["a"].dtype == torch.float32
    torch.testing.assert_close(targets["a"], sources["a"].float())
    torch.testing.assert_close(fused, torch.cat([sources["q"], sources["k"]]).to(torch.bfloat16))


def test_a_source_is_copied_before_the_next_batch_is_read_once_pending_bytes_are_full(monkeypatch):
    monkeypatch.setattr(weight_copy, "PENDING_BYTES", 2 * 4 * 16)  # two tensors of 16 floats
    targets = {f"w{i}": torch.zeros(16) for i in range(5)}
    written_when_yielding = []

    def read_one_at_a_time():
        for i in range(5):
            written_when_yielding.append(sum(bool(targets[f"w{j}"].any()) for j in range(i)))
            yield f"w{i}", torch.full((16,), float(i + 1))

    copy_named_tensors(targets, read_one_at_a_time(), owner="the test model")
    assert written_when_yielding == [0, 0, 2, 2, 4]
    assert all(torch.equal(targets[f"w{i}"], torch.full((16,), float(i + 1))) for i in range(5))


def test_an_unknown_name_or_another_shape_says_what_to_send():
    targets = {"model.embed_tokens.weight": torch.zeros(4, 2)}
    with pytest.raises(KeyError, match="send the model's own .* such as 'model.embed_tokens.weight'"):
        copy_named_tensors(targets, [("embed.weight", torch.zeros(4, 2))], owner="the test model")
    with pytest.raises(ValueError, match=r"shape \(2, 2\), the test model has \(4, 2\)"):
        copy_named_tensors(targets, [("model.embed_tokens.weight", torch.zeros(2, 2))], owner="the test model")
