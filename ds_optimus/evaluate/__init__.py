"""Downstream evaluation with lm-evaluation-harness, as Optimus scored its checkpoints (`python -m
ds_optimus.evaluate`). Names load on first use (`--help` needs no PyTorch)."""

from .._lazy import lazy_exports

__all__ = ["DownstreamConfig", "EvalConfig", "EvaluationError", "evaluate", "export_checkpoint", "resolve", "score"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DownstreamConfig": ".downstream_config",
        "EvalConfig": ".downstream_config",
        "EvaluationError": ".harness",
        "score": ".harness",
        "evaluate": ".run",
        "export_checkpoint": ".run",
        "resolve": ".run",
    },
)
