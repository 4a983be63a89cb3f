"""Optimizer-side integration with DeepSpeed. Every touch of DeepSpeed's private API lives in
`deepspeed_compat`, pinned to the tested DeepSpeed version."""
