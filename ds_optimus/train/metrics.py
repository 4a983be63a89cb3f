"""Per-step training metrics: reduction over ranks, model FLOPs, and the sinks (progress bar,
`metrics.jsonl`, wandb)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active parameters (forward + backward matmuls) plus the
    attention score and value products, 12 x layers x attention width x sequence length (the
    planner's figure, `ds_optimus.plan.ModelShape.flops_per_token`)."""
    from ..plan.model import ModelShape

    return ModelShape.from_config(config).flops_per_token(seq_len)


def reduce_mean(values: dict[str, float], group=None) -> dict[str, float]:
    """The mean of each scalar over the ranks of `group` (one all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(values)
    packed = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(packed, group=group)
    packed /= dist.get_world_size(group)
    return dict(zip(values, packed.tolist(), strict=True))


def reduce_sum_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.to(torch.float64)
        dist.all_reduce(tensor)
    return tensor


def expert_imbalance(tokens_per_expert: torch.Tensor) -> list[float]:
    """Max over mean tokens per expert, for each MoE layer (1.0 is perfect balance)."""
    counts = tokens_per_expert.to(torch.float64)
    mean = counts.mean(dim=-1).clamp_min(1e-9)
    return (counts.max(dim=-1).values / mean).tolist()


class MetricsSink:
    """Rank 0's outputs: a progress bar, `metrics.jsonl` and `log.txt` (always) and wandb (if enabled)."""

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, wandb_config, run_config: dict,
                 enabled: bool) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # resumed: keep the lines up to the checkpoint; a fresh start: none
            kept = [line for line in self.path.read_text().splitlines()
                    if start_step and line.strip() and json.loads(line).get("step", 0) <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, desc="training", unit="step", dynamic_ncols=True,
                        file=sys.stderr)
        mode = wandb_config.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=wandb_config.project, name=wandb_config.name, entity=wandb_config.entity,
                                    dir=str(output_dir), mode=mode, config=run_config, resume="allow")

    def log(self, step: int, metrics: dict[str, Any], progress: bool = True) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.bar is not None and progress:
            shown = {k: metrics[k] for k in ("loss", "lr", "tokens_per_s") if k in metrics}
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})
            self.bar.update(step - self.bar.n)

    def message(self, text: str) -> None:
        """Show `text` and append it, timestamped, to `log.txt` beside the metrics (skipped steps,
        rollbacks, damaged checkpoints stay on record)."""
        if not self.enabled:
            return
        with self.path.with_name("log.txt").open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
