"""Triton kernels of ember's generation engine (CUDA only; imported lazily where a tensor is on CUDA).

`paged_decode.py`: decode attention reading each sequence's KV blocks in place.
`rope_cache.py`: RoPE of a step's queries and keys, with keys and values written to their cache slots.
`sample.py`: Gumbel-max sampling and the token's log-prob in one pass over each logits row.
`norm_act.py`: RMSNorm (with the residual add) and SwiGLU's gating.
Each has a PyTorch counterpart that is the reference on every device (`attention.py`, `sampling.py`).
"""
