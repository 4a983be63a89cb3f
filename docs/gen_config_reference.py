"""Write docs/reference/config.md: every key of the `optimus` section, from the config dataclasses.

The sections are the `ds_optimus.schema.Section` dataclasses that `ds_optimus.config.OptimusConfig`
assembles (each declared beside its component). A key's meaning is the `#` comment on its field's
line or, without one, the comment lines right above the field; its default is the value an empty
section holds. Run it after changing a section (a test compares the committed page with its output):

    python docs/gen_config_reference.py           # rewrite the page
    python docs/gen_config_reference.py --check   # exit 1 if the page is out of date
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import textwrap
import tokenize
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "reference" / "config.md"


@dataclass(frozen=True)
class Key:
    """One leaf key of the `optimus` section."""

    name: str  # dotted, from the section: "optimus.train.steps"
    type: str  # in JSON's words: "integer or null"
    default: str  # as JSON
    doc: str  # one line of meaning ("" when the field has no comment)


@dataclass(frozen=True)
class SectionDoc:
    name: str  # "optimus.train"
    summary: str  # the class docstring, less its leading "`optimus.x`: "
    cls: type
    keys: list[Key]


def field_comments(cls: type) -> dict[str, tuple[str, str]]:
    """(annotation source, comment) of each field declared in `cls`'s body: the comment on the
    field's line, else the comment lines directly above it (no blank line between), joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        annotation = ast.get_source_segment(source, node.annotation)
        own = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above, n = [], node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        out[node.target.id] = (annotation, " ".join(own or above))
    return out


_WORDS = {
    "int": "integer",
    "float": "number",
    "str": "string",
    "bool": "true/false",
    "dict": "object",
    "list": "list",
    "None": "null",
    "tuple": "list",
}


def json_type(annotation: str) -> str:
    """A Python annotation in the words of a JSON config: `int | None` -> "integer or null"."""

    def one(node: ast.expr) -> str:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return f"{one(node.left)} or {one(node.right)}"
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("list", "tuple"):
            inner = ast.unparse(node.slice).split(",")[0].strip()
            return f"list of {_WORDS.get(inner, inner)}s"
        if isinstance(node, ast.Constant) and node.value is None:
            return "null"
        name = ast.unparse(node)
        return _WORDS.get(name, name)

    return one(ast.parse(annotation, mode="eval").body)


def is_section(f) -> bool:
    from ds_optimus.schema import Section

    factory = f.default_factory
    return factory is not MISSING and is_dataclass(factory) and issubclass(factory, Section)


def sections(cls=None, where: str = "optimus") -> list[SectionDoc]:
    """Every section under `cls` (default: `OptimusConfig`), depth first, with its leaf keys."""
    if cls is None:
        from ds_optimus.config import OptimusConfig

        cls = OptimusConfig
    empty = cls()
    docs = field_comments(cls)
    keys, nested = [], []
    for f in fields(cls):
        if is_section(f):
            nested += sections(f.default_factory, f"{where}.{f.name}")
            continue
        annotation, doc = docs.get(f.name, (str(f.type), ""))
        keys.append(Key(f"{where}.{f.name}", json_type(annotation), json.dumps(getattr(empty, f.name)), doc))
    summary = " ".join((cls.__doc__ or "").split())
    prefix = f"`{where}`: "
    summary = summary[len(prefix) :] if summary.startswith(prefix) else summary
    return ([SectionDoc(where, summary, cls, keys)] if keys else []) + nested


def undocumented() -> list[str]:
    """Keys whose field has no comment to say what they mean."""
    return [key.name for section in sections() for key in section.keys if not key.doc]


# The docs page that explains each section's component, linked under its table.
TOPICS = {
    "optimus.model": ("Models and conversion", "../models.md"),
    "optimus.expert_parallel": ("Expert parallelism", "../parallelism.md#expert-parallelism"),
    "optimus.pipeline_parallel": ("Pipeline parallelism", "../parallelism.md#pipeline-parallelism"),
    "optimus.moe": ("MoE layer and kernels", "../moe.md"),
    "optimus.data": ("Pretraining data", "../data.md"),
    "optimus.train": ("Pretraining", "../pretraining.md"),
    "optimus.checkpoint": ("Reliability", "../reliability.md#checkpoints-you-can-trust"),
    "optimus.wandb": ("Pretraining", "../pretraining.md#metrics"),
    "optimus.sharded_optimizer": ("The EP-aware sharded optimizer", "../optimizer.md"),
    "optimus.guards": ("Reliability", "../reliability.md#numerical-guards"),
    "optimus.watchdog": ("Reliability", "../reliability.md#hang-watchdog"),
    "optimus.eval.downstream": ("Evaluation", "../evaluation.md"),
}


def cell(text: str) -> str:
    """Text fit for a Markdown table cell: pipes escaped, and angle brackets outside code spans."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def render() -> str:
    """The page's Markdown."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/gen_config_reference.py from the config dataclasses: do not edit by hand. -->",
        "",
        "Every key of the `optimus` section of a DeepSpeed JSON config, with its type, its default and what it",
        "does. Every section and key is optional. An unknown key or a bad value stops a run before any work",
        "with one line naming the key; `python -m ds_optimus.train --config X.json --check` says so without",
        "launching. Any key can be set from the command line with `--set KEY=VALUE` (dotted, e.g.",
        "`--set optimus.train.steps=50`; the value parses as JSON where it can). DeepSpeed's own keys (batch",
        "sizes, `optimizer`, `scheduler`, `zero_optimization`, `bf16`, ...) are DeepSpeed's: see",
        "[Pretraining](../pretraining.md#the-config) for how the two parts work together.",
        "",
        "This page is generated from the dataclasses that parse the section (`ds_optimus.schema.Section`,",
        "each declared beside the component it configures): a key's line is the comment on its field.",
        "",
    ]
    for section in sections():
        module = section.cls.__module__
        title, link = TOPICS.get(section.name, (None, None))
        more = f" More in [{title}]({link})." if title else ""
        out += [
            f"## `{section.name}`",
            "",
            f"{sentence(section.summary)} (`{module}.{section.cls.__name__}`){more}",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for key in section.keys:
            short = key.name[len(section.name) + 1 :]
            out.append(f"| `{short}` | {cell(key.type)} | `{cell(key.default)}` | {cell(sentence(key.doc))} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the configuration reference page from the dataclasses.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is out of date")
    args = parser.parse_args(argv)
    missing = undocumented()
    if missing:
        print(f"no comment says what these keys mean: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python docs/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
