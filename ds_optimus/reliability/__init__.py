"""Reliability for long runs: `guards`, `watchdog`, `supervise` and `signals` (checkpoints: `ds_optimus.checkpoint`)."""
