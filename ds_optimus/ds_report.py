"""`python -m ds_optimus.ds_report`: DeepSpeed's `ds_report` with ds_optimus' op among DeepSpeed's.

Same options; for `moe_routing`, "installed" means prebuilt (`DS_BUILD_MOE_ROUTING=1`), "compatible"
buildable here (on GPUs: Triton is installed).
"""

from __future__ import annotations


def main() -> None:
    import ds_optimus  # noqa: F401  (registers the op with DeepSpeed)
    from ds_optimus.integrations.deepspeed_ops import register_ops

    register_ops()
    from deepspeed.env_report import cli_main

    cli_main()


if __name__ == "__main__":
    main()
