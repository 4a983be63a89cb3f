"""`python -m ds_optimus.ds_report`: DeepSpeed's `ds_report` with ds_optimus' op among DeepSpeed's.

DeepSpeed's own `ds_report` command lists the ops found in DeepSpeed's folder; ds_optimus' op
(`moe_routing`: the MoE layer's routing, gather and combine) joins that list once ds_optimus is
imported (`ds_optimus.integrations.deepspeed_ops.register_ops`). This runs the same report, with the
same options, after that import: "installed" says the CPU op was prebuilt at install
(`DS_BUILD_MOE_ROUTING=1`), "compatible" that it can be built here (or, on GPUs, that Triton is there).
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
