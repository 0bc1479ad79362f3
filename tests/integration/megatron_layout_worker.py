"""Two-rank worker (torchrun, gloo): a tiny HF model into megatron-core under one parallel layout and back.

Usage: torchrun --nproc_per_node 2 megatron_layout_worker.py MODEL_DIR OUT_FILE LAYOUT
LAYOUT is tp2 (with sequence parallel asked for), pp2, pp2_vpp2 or ep2. Each rank builds its shards
with ember's bridge (local layer spec, CPU initialisation), loads the HF weights into them and exports
every weight back under its HF name (shards gathered); rank 0 saves the export and what the layout
resolved to."""

import sys

import torch
import torch.distributed as dist

from ember.engines.megatron.bridge import build_model_chunks, hf_named_weights, load_bridge, transformer_engine_available
from ember.engines.megatron.options import MegatronOptions, layout_settings
from ember.engines.megatron.parallel import initialize_layout

LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "pp2": dict(pipeline_model_parallel_size=2),
           "pp2_vpp2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
           "ep2": dict(expert_model_parallel_size=2)}


def main(model_dir: str, out_file: str, layout: str) -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # Stand-ins a CPU needs: the MoE dispatcher's CUDA stream (made at build; it holds no weights), and the
    # device mbridge allocates a pipeline broadcast's receive buffer on (the current CUDA device).
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    torch.cuda.current_device = lambda: "cpu"
    options = MegatronOptions(model_path=model_dir, **LAYOUTS[layout])
    initialize_layout(options.layout, seed=1)
    settings = {**layout_settings(options, transformer_engine_available()),
                "use_cpu_initialization": True}
    bridge = load_bridge(model_dir, torch.float32, settings)
    chunks = build_model_chunks(bridge, options.virtual_pipeline_model_parallel_size)
    bridge.load_weights(chunks, model_dir)
    exported = {name: tensor.clone() for name, tensor in hf_named_weights(bridge, chunks)}
    if dist.get_rank() == 0:
        torch.save({"weights": exported, "chunks": len(chunks), "sequence_parallel": bridge.config.sequence_parallel,
                    "layers": [len(chunk.decoder.layers) for chunk in chunks]}, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
