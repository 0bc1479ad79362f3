"""The end of an RL run: the final policy exported as a Hugging Face directory (unless its weights
are unsound, `BadStepGuard`: then the warning names the last sound checkpoint to export instead), a
PNG of reward and validation accuracy, and a table of accuracy before and after training."""

from __future__ import annotations

import logging
import os

from ember.distributed.device import rank
from ember.trainer.loggers import format_duration, read_jsonl_metrics
from ember.trainer.plot import plot_curves, rl_curve_keys

logger = logging.getLogger("ember.trainer")


def accuracy_table(history: list[tuple[int, dict[str, float]]], steps: int, seconds: float) -> str:
    """Rows: accuracy per data source at the first and the last validation, each column headed by
    the step it was measured at (one column when the run validated once), then steps and time."""
    if not history:
        return f"steps {steps} | time {format_duration(seconds)} (no validation set)"
    columns = [history[0], history[-1]] if len(history) > 1 else history
    headers = [validation_label(step) for step, _ in columns]
    keys = [key for key in columns[-1][1] if key.startswith("val-core/")]
    width = max(len(key) for key in keys)
    lines = ["  ".join([f"{'metric':<{width}}"] + headers)]
    lines += ["  ".join([f"{key:<{width}}"] + [f"{metrics.get(key, float('nan')):>{len(header)}.3f}"
                                             for (_, metrics), header in zip(columns, headers)]) for key in keys]
    first = len(headers[0])
    lines += [f"{'steps':<{width}}  {steps:>{first}d}", f"{'time':<{width}}  {format_duration(seconds):>{first}}"]
    return "\n".join(lines)


def validation_label(step: int) -> str:
    """The heading of a validation measured after `step` updates."""
    return "before training" if step == 0 else f"after step {step}"


def finish_rl_run(trainer, seconds: float) -> dict[str, float]:
    """Exports, plots and prints; returns the last validation metrics."""
    run_dir = trainer.run_dir
    export_dir = os.path.join(run_dir, "hf_model")
    if trainer.guard.weights_sound:
        trainer.parts.actor.export_hf(export_dir, tokenizer=trainer.parts.tokenizer)
        final_model = f"final model (Hugging Face format): {export_dir}"
    else:
        final_model = trainer.guard.unsound_export_message(export_dir)
        if rank() == 0:
            logger.warning(final_model)
    if rank() != 0:
        return {}
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    plot_path = plot_curves(metrics_path, os.path.join(run_dir, "curves.png"),
                            rl_curve_keys(read_jsonl_metrics(metrics_path)), "reward and validation accuracy")
    print(accuracy_table(trainer.validation_history, trainer.step, seconds), flush=True)
    print(f"{final_model}\ncurves: {plot_path}\n"
          f"TensorBoard: tensorboard --logdir {os.path.join(run_dir, 'tensorboard')}", flush=True)
    return trainer.validation_history[-1][1] if trainer.validation_history else {}
