"""Reliability for long runs: numerical guards (`guards`), the hang watchdog (`watchdog`), the
supervisor that restarts a failed run (`supervise`) and signals (`signals`). Checkpoints are in
`ds_optimus.checkpoint`."""
