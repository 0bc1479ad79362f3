"""Log-probs and entropy over a vocabulary split between tensor-parallel ranks (the Megatron
engine at TP > 1): two gloo ranks against the full log-softmax, values and gradients."""

from pathlib import Path

from two_ranks import run_two_ranks, worker_environment

WORKER = Path(__file__).with_name("vocab_parallel_worker.py")


def test_two_ranks_with_half_the_vocabulary_each_match_the_full_softmax(tmp_path):
    out = tmp_path / "ok"
    run_two_ranks(str(WORKER), str(out), timeout=120, environment=worker_environment())
    assert out.read_text() == "ok"
