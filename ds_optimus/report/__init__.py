"""Plots of a training run, from its `metrics.jsonl`: `python -m ds_optimus.report RUN_DIR`.

Writes `RUN_DIR/plots/*.png`. A leaf (it imports nothing else of ds_optimus): numpy and matplotlib suffice.
"""

from .plots import MissingMatplotlib, write_report
from .reader import ExpertLoads, ReportError, RunMetrics, load_metrics

__all__ = ["ExpertLoads", "MissingMatplotlib", "ReportError", "RunMetrics", "load_metrics", "write_report"]
