"""HF weights through megatron-core and back under each 2-rank layout (gloo, CPU): tensor parallel,
pipeline parallel, pipeline with virtual stages, expert parallel. Each shard is loaded from the HF
checkpoint and gathered back under its HF name, so a wrong split, a layer on the wrong stage or an
expert under the wrong global index changes some tensor. (Forwards need CUDA: tests/gpu/
test_megatron_parallel_gpu.py compares the layouts' log-probs and updates on two GPUs.)"""

import os

import pytest
import torch
from fixtures import make_tiny_model_dir
from safetensors.torch import load_file
from two_ranks import run_two_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

WORKER = os.path.join(os.path.dirname(__file__), "megatron_layout_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("layout, arch, chunks", [("tp2", "qwen2", 1), ("pp2", "llama", 1), ("pp2_vpp2", "qwen3", 2),
                                                  ("ep2", "qwen2_moe", 1)])
def test_each_layout_loads_and_gives_back_every_hf_weight(tmp_path, layout, arch, chunks):
    model_dir = make_tiny_model_dir(tmp_path, arch, num_hidden_layers=4)
    run_two_ranks(WORKER, str(model_dir), str(tmp_path / "out.pt"), layout, timeout=240)
    result = torch.load(tmp_path / "out.pt")
    original = load_file(model_dir / "model.safetensors")
    assert set(result["weights"]) == set(original)
    for name, tensor in original.items():
        torch.testing.assert_close(result["weights"][name], tensor, rtol=0, atol=0, msg=name)
    assert result["chunks"] == chunks
    assert sum(result["layers"]) == 4 // (2 if layout.startswith("pp") else 1)  # rank 0's share of the 4 layers
    if layout == "tp2":  # asked for; the local spec (no Transformer Engine here) has no sequence-parallel norm
        from ember.engines.megatron.bridge import transformer_engine_available

        assert result["sequence_parallel"] == transformer_engine_available()
