"""ember's generation engine: token ids in, sampled token ids and their log-probs out.

After nano-vllm: `scheduler.py` (continuous batching), `block_manager.py` (paged KV
blocks, prefix sharing of the n samples of a prompt), `model_runner.py` (one step of the
model), `models/` (ember's own decoder forward), `attention.py` (attention over the paged
cache), `sampling.py`, and `engine.py` (`LLMEngine`, tying them together). `request.py` holds
what a call asks for (`SamplingParams`, `Injection`), which the rollout interface takes too.

`EngineConfig` and `LLMEngine` are imported on first use, so that reading the request records
(every importer of `ember.rollout`) does not load the engine's models and kernels.
"""

__all__ = ["EngineConfig", "LLMEngine"]


def __getattr__(name: str):
    if name == "EngineConfig":
        from ember.inference.config import EngineConfig

        return EngineConfig
    if name == "LLMEngine":
        from ember.inference.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'ember.inference' has no attribute {name!r}")
