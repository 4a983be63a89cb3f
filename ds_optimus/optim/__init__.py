"""The EP-aware sharded optimizer.

`sharded` (the optimizer: buckets and shards in `spaces` and `layout`, its saved state in
`shard_state`, fp16 loss scaling in `loss_scale`), `config` and `warmup_clipping` (the clip value of
each step) need only PyTorch; `checkpointing` (the engine's layout-free checkpoints) needs DeepSpeed.
How DeepSpeed's engine builds and drives the optimizer is in `ds_optimus.integrations.deepspeed_engine`.
Import the submodules directly."""
