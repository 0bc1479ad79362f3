"""A PNG of the curves a person looks at first: training reward and validation accuracy
per step (RL), or training and validation loss (SFT), drawn from the run's metrics.jsonl.
matplotlib is imported when a plot is drawn, at the end of a run, not at start-up."""

from __future__ import annotations

from ember.trainer.loggers import read_jsonl_metrics


def plot_curves(metrics_path: str, out_path: str, keys: list[str], title: str) -> str:
    """One line per key found in the metrics (validation keys may be sparse); returns out_path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl_metrics(metrics_path)
    figure, axis = plt.subplots(figsize=(7, 4))
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            steps, values = zip(*points)
            axis.plot(steps, values, marker="o" if len(points) < 30 else None, label=key)
    axis.set_xlabel("step")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
    return out_path


def rl_curve_keys(records: list[dict[str, float]]) -> list[str]:
    """Reward and every validation accuracy present in the run."""
    keys = {"critic/score/mean"}
    for record in records:
        keys.update(k for k in record if k.startswith("val-core/") and k.endswith("/acc"))
    return sorted(keys)
