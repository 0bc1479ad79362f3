"""The top-p cut's threshold alone: the sorted row against the search of `kernels/nucleus.py`, in CUDA graphs.

For each row count and logit spread: milliseconds per call of each (mean of replays of a captured graph), and in how
many rows the two cut elsewhere (rows whose cut lies within float32's rounding of the running sum).

    python benchmarks/top_p_threshold.py [--rows 64 512] [--vocab 151936] [--top-p 0.9] [--scales 1 4]
"""

from __future__ import annotations

import argparse

import torch

from ember.inference.kernels.nucleus import nucleus_threshold
from ember.inference.sampling import sorted_nucleus_threshold


def graph_ms(fn, replays: int = 20) -> float:
    """Milliseconds per replay of `fn` captured in a CUDA graph (after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 4.0], help="standard deviations of the logits")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  vocabulary {args.vocab}, top-p {args.top_p}")
    print("| rows | logits | sorted ms | search ms | rows cut elsewhere |\n|---|---|---|---|---|")
    for rows in args.rows:
        for scale in args.scales:
            scaled = torch.randn(rows, args.vocab, device="cuda") * scale
            differ = ((scaled < sorted_nucleus_threshold(scaled, args.top_p)) != (scaled < nucleus_threshold(scaled, args.top_p)))
            print(f"| {rows} | N(0, {scale:g}²) | {graph_ms(lambda: sorted_nucleus_threshold(scaled, args.top_p)):.3f} | "
                  f"{graph_ms(lambda: nucleus_threshold(scaled, args.top_p)):.3f} | {int(differ.any(-1).sum())} |", flush=True)


if __name__ == "__main__":
    main()
