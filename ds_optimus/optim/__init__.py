"""The EP-aware sharded optimizer and its registration with DeepSpeed's engine.

`sharded` (the optimizer: buckets and shards in `spaces` and `layout`, its saved state in
`shard_state`, fp16 loss scaling in `loss_scale`) and `config` need only PyTorch; `checkpointing`
(the engine's layout-free checkpoints) and `deepspeed_compat` (DeepSpeed's private API, version-checked,
and the engine adapter) need DeepSpeed; `clipping` switches a built engine's gradient clipping (the one
other touch of DeepSpeed's internals) without importing it. Import the submodules directly."""
