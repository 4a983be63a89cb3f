"""Where a run's metrics and messages go: the progress bar, `metrics.jsonl`, `log.txt` and wandb."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..run_log import append_log  # noqa: F401  (the trainer's and the tests' name for it)

LOSS_PARTS = ("loss", "lm_loss", "aux_loss", "z_loss")  # what a Mula output reports of its loss


def expert_imbalance(tokens_per_expert) -> list[float]:
    """Max over mean tokens per expert for each MoE layer (1.0: balanced), from per-layer rows of counts."""
    rows = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else tokens_per_expert
    return [max(row) / max(sum(row) / len(row), 1e-9) for row in rows]


def expert_token_counts(tokens_per_expert) -> list[list[int]]:
    """Per-layer rows of token-slot counts as integers: `metrics.jsonl`'s `expert_tokens` field."""
    rows = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else tokens_per_expert
    return [[round(count) for count in row] for row in rows]


# metrics.jsonl only: wandb gets the per-layer imbalance, not a table of counts per logged step
FILE_ONLY = frozenset({"expert_tokens"})


class MetricsSink:
    """Rank 0's outputs: a progress bar, `metrics.jsonl` and `log.txt` (always) and wandb (if enabled)."""

    def __init__(
        self, output_dir: Path, total_steps: int, start_step: int, wandb_config, run_config: dict, enabled: bool
    ) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # resumed: keep the lines up to the checkpoint; a fresh start: none
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if start_step and line.strip() and json.loads(line).get("step", 0) <= start_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        mode = wandb_config.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if mode != "disabled":  # before the bar: what wandb prints at its start does not cut through it
            import wandb

            from ..verbosity import verbose_requested

            # the run's own wandb run is quiet in a script too, as in the command line: no banner, no summary
            settings = None if verbose_requested() or os.environ.get("WANDB_SILENT") else wandb.Settings(silent=True)
            self.wandb = wandb.init(
                project=wandb_config.project,
                name=wandb_config.name,
                entity=wandb_config.entity,
                dir=str(output_dir),
                mode=mode,
                config=run_config,
                resume="allow",
                settings=settings,
            )
        from ..progress import progress

        self.bar = progress(total=total_steps, initial=start_step, desc="training", unit="step")

    def log(self, step: int, metrics: dict[str, Any], progress: bool = True) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k not in FILE_ONLY}, step=step)
        if self.bar is not None and progress:
            shown = {k: metrics[k] for k in ("loss", "lr", "tokens_per_s") if k in metrics}
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})
            self.bar.update(step - self.bar.n)

    def log_to_wandb(self, step: int, metrics: dict[str, Any]) -> None:
        """Send `metrics` to wandb alone (not metrics.jsonl), at `step`."""
        if self.enabled and self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def message(self, text: str) -> None:
        """Show `text` and append it, timestamped, to `log.txt`."""
        if not self.enabled:
            return
        append_log(self.path.parent, text)
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def end_progress(self) -> None:
        """End the progress bar; messages go on."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        """End the progress bar and the wandb run (again: nothing)."""
        self.end_progress()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
