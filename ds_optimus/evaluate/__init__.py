"""Downstream evaluation with lm-evaluation-harness (`pip install -e ".[eval]"`), as Optimus (the Mula runs on Aurora)
scored its checkpoints: `python -m ds_optimus.evaluate RUN_OR_FOLDER --tasks ...` scores a Hugging
Face folder, a checkpoint (exported on the fly) or a run's checkpoints and writes
`<run>/eval/step_N.json`, which the run's report plots; `optimus.eval.downstream` does it at every
checkpoint of a training run. Names are imported on first use (`--help` needs no PyTorch)."""

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
