"""Which tasks to run: lm-eval's names, Optimus' `mula-suite`, the user's YAML files, and `pydoc_cloze`, made from
the embedded corpus so that a run is scored with nothing downloaded (a smoke test: the tiny presets train on it)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

# What Optimus (the Mula runs on Aurora) scored its checkpoints on (its evaluation scripts, with
# lm-evaluation-harness).
MULA_SUITE = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "boolq", "sciq", "winogrande", "openbookqa", "mmlu")
BUILTIN = {"pydoc_cloze"}

_YAML = """task: pydoc_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def expand(tasks: list[str]) -> list[str]:
    """Task names with `mula-suite` replaced by its tasks, each name once, in order."""
    out: list[str] = []
    for task in tasks:
        for name in MULA_SUITE if task == "mula-suite" else (task,):
            if name not in out:
                out.append(name)
    return out


def write_pydoc_cloze(folder: Path, items: int = 200, seed: int = 0) -> Path:
    """Write the `pydoc_cloze` task (YAML and JSONL) into `folder`, returned: each item completes the first two
    thirds of a manual sentence with its own ending among four; deterministic in `seed`."""
    from ..data.documents import embedded_documents

    sentences = []
    for document in embedded_documents():  # up to 4 sentences of each topic of the manual
        found = [
            s.split()
            for s in re.split(r"(?<=\.)\s+", " ".join(document.split()))
            if 10 <= len(s.split()) <= 30 and s[0].isupper() and s.endswith(".")
        ]
        sentences += [words for words in found[:: max(1, len(found) // 4)][:4] if words not in sentences]
    rng = random.Random(seed)
    rng.shuffle(sentences)
    sentences = sentences[:items]
    cut = [len(words) * 2 // 3 for words in sentences]
    endings = [" ".join(words[k:]) for words, k in zip(sentences, cut, strict=True)]
    lines = []
    for i, (words, k) in enumerate(zip(sentences, cut, strict=True)):
        others = rng.sample(sorted({e for e in endings if e != endings[i]}), 3)
        choices = [endings[i], *others]
        rng.shuffle(choices)
        lines.append(
            json.dumps({"context": " ".join(words[:k]), "choices": choices, "label": choices.index(endings[i])})
        )
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "pydoc_cloze.jsonl"
    data.write_text("\n".join(lines) + "\n")
    # the data path absolute: lm-eval resolves it against the working directory
    (folder / "pydoc_cloze.yaml").write_text(_YAML.format(data=json.dumps(str(data.resolve()))))
    return folder
