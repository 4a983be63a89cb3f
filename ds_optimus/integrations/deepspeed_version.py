"""The DeepSpeed versions ds_optimus' patches were written and tested against."""

from __future__ import annotations

import deepspeed

TESTED_VERSIONS = ("0.19.",)


def check_version(version: str | None = None) -> None:
    """Raise RuntimeError unless DeepSpeed's version is one this module was tested with."""
    version = version or deepspeed.__version__
    if not version.startswith(TESTED_VERSIONS):
        raise RuntimeError(
            f"ds_optimus supports DeepSpeed {', '.join(v + 'x' for v in TESTED_VERSIONS)}, found {version}; "
            "install a supported version (pip install 'deepspeed>=0.19.8,<0.20')"
        )
