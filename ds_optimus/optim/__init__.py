"""The EP-aware sharded optimizer (`sharded`, `layout`, `checkpointing`) and its registration with
DeepSpeed's engine. Every touch of DeepSpeed's private API lives in `deepspeed_compat`, pinned to
the tested DeepSpeed version. Needs DeepSpeed: import the submodules directly."""
