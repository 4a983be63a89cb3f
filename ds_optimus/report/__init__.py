"""Plots of a training run, from its `metrics.jsonl`: `python -m ds_optimus.report RUN_DIR`.

Loss and held-out loss, learning rate, gradient norm, throughput and MFU, skipped updates, and the
experts' load (a heatmap of tokens per expert, layer by layer, over the steps) go to
`RUN_DIR/plots/*.png`. A leaf: it reads files and imports nothing else of ds_optimus, so it runs
on a laptop beside a copy of the run folder (numpy and matplotlib are all it needs).
"""

from .plots import MissingMatplotlib, write_report
from .reader import ExpertLoads, ReportError, RunMetrics, load_metrics

__all__ = ["ExpertLoads", "MissingMatplotlib", "ReportError", "RunMetrics", "load_metrics", "write_report"]
