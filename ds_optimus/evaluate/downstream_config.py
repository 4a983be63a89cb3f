"""`optimus.eval.downstream`: tasks scored at every checkpoint through lm-evaluation-harness (the `eval` extra)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schema import Section, need, non_negative_int, positive_int


@dataclass(frozen=True)
class DownstreamConfig(Section):
    """Downstream evaluation settings; no tasks: off."""

    tasks: list = field(default_factory=list)  # scored at every checkpoint; lm-eval names, `mula-suite`, `pydoc_cloze`
    include: list = field(default_factory=list)  # folders of YAML task files of your own
    limit: int | None = None  # documents of each task; null: all
    num_fewshot: int = 0  # few-shot examples before each question
    batch_size: int = 8  # the evaluation's batch size

    def check(self, where: str) -> None:
        need(
            isinstance(self.tasks, list) and all(isinstance(t, str) and t for t in self.tasks),
            f"{where}.tasks must be a list of task names, got {self.tasks!r}",
        )
        need(
            isinstance(self.include, list) and all(isinstance(p, str) for p in self.include),
            f"{where}.include must be a list of folders, got {self.include!r}",
        )
        need(self.limit is None or positive_int(self.limit), f"{where}.limit must be null or a positive integer")
        need(non_negative_int(self.num_fewshot), f"{where}.num_fewshot must be an integer >= 0")
        need(positive_int(self.batch_size), f"{where}.batch_size must be a positive integer")

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)


@dataclass(frozen=True)
class EvalConfig(Section):
    """`optimus.eval`: evaluation beyond the held-out loss (`optimus.train.eval_interval`)."""

    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
