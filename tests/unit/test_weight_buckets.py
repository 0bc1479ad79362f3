"""in_buckets / in_dtype_buckets: weights streamed to a rollout engine in buckets, cast per bucket."""

import torch

from ember.engines.batching import in_buckets, in_dtype_buckets


def named(sizes, dtype=torch.float32):
    return [(f"w{i}", torch.randn(size, dtype=dtype)) for i, size in enumerate(sizes)]


def test_buckets_close_once_they_reach_the_size_and_keep_the_order():
    weights = named([4, 4, 4, 2, 8])  # 16, 16, 16, 8, 32 bytes
    buckets = list(in_buckets(iter(weights), bucket_bytes=32))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["w0", "w1"], ["w2", "w3", "w4"]]


def test_dtype_buckets_cast_into_one_buffer_per_bucket_and_pass_matching_tensors_as_they_are():
    weights = named([(3, 2), 5, 4]) + [("already", torch.randn(3, dtype=torch.bfloat16))]
    buckets = list(in_dtype_buckets(iter(weights), bucket_bytes=1 << 20, dtype=torch.bfloat16))
    assert len(buckets) == 1
    out = dict(buckets[0])
    assert [name for name, _ in buckets[0]] == [name for name, _ in weights]
    for name, source in weights:
        assert out[name].dtype == torch.bfloat16 and out[name].shape == source.shape
        torch.testing.assert_close(out[name], source.to(torch.bfloat16), atol=0, rtol=0)
    assert out["already"] is dict(weights)["already"]
    cast = [out[f"w{i}"] for i in range(3)]
    assert len({tensor.untyped_storage().data_ptr() for tensor in cast}) == 1  # one buffer for the bucket
    assert not any(tensor.requires_grad for tensor in cast)


def test_dtype_buckets_leave_the_sources_unchanged():
    weights = named([4, 6])
    before = [tensor.clone() for _, tensor in weights]
    for bucket in in_dtype_buckets(iter(weights), bucket_bytes=16, dtype=torch.float16):
        for _, tensor in bucket:
            tensor.zero_()
    assert all(torch.equal(tensor, kept) for (_, tensor), kept in zip(weights, before))
