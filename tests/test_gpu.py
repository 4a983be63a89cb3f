"""On a CUDA device (`python -m pytest -m gpu`; skipped without one, so CI collects and skips them).

- The Triton expert kernels compiled for real (not Triton's interpreter) against the float64
  reference, forward and every gradient, float32 and bfloat16, over the shapes of test_kernels.py
  and the OLMoE-1B-7B layer shape.
- The Mula MoE model trained 20 steps in bfloat16 against the same model in float32.
- One process of `ds_optimus.train` through the `deepspeed` launcher (NCCL, the sharded optimizer,
  bf16) stopped at step 3 and resumed: the per-step losses of the uninterrupted run, bitwise.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_fault_tolerance import launch, step_losses, write_config
from test_kernels import CASES, TOL, fused, make_case, oracle, rel
from train_workers import tiny_config

import ds_optimus.ops as ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OLMOE = (4096, 2048, 1024, 64, 8, "random")  # tokens, hidden, expert intermediate, experts, top-k


@pytest.mark.skipif(not ops.triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [*CASES, OLMOE], ids=lambda c: "-".join(map(str, c)))
def test_compiled_kernels_match_the_reference(case, dtype):
    assert os.environ.get("TRITON_INTERPRET") != "1", "the kernels must be compiled, not interpreted"
    plan, tensors = make_case(*case, dtype)
    got = fused(plan, *tensors)
    want = oracle(plan, *tensors)
    for name, g, w in zip(("out", "x", "gate_up", "down", "weights"), got, want, strict=True):
        assert rel(g, w) <= TOL[dtype], (name, rel(g, w))


def _train_losses(dtype: torch.dtype, steps: int = 20) -> list[float]:
    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM

    torch.manual_seed(0)
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe")).to("cuda", dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(2, model.config.vocab_size, (8, 64), generator=gen).cuda() for _ in range(4)]
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_bfloat16_training_tracks_float32():
    """Every step's loss within 3 % of float32's over 20 steps (the bf16 weights and activations'
    rounding, compounded by training), and both fall."""
    fp32, bf16 = _train_losses(torch.float32), _train_losses(torch.bfloat16)
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16, strict=True))
    assert worst <= 0.03, (worst, fp32, bf16)
    assert bf16[-1] < bf16[0] - 0.5 and fp32[-1] < fp32[0] - 0.5


def test_stopped_and_resumed_cuda_run_has_the_same_losses_bitwise(tmp_path):
    def run(name: str, config: dict, times: int = 1) -> dict[int, float]:
        folder = tmp_path / name
        folder.mkdir()
        config["optimus"]["train"]["output_dir"] = str(folder / "run")
        path = write_config(folder, config)
        for _ in range(times):
            proc = launch(path, procs=1)  # the deepspeed launcher on this machine's GPU: NCCL
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return step_losses(folder / "run")

    whole = tiny_config(tmp_path, tmp_path / "cache", sharded_optimizer={"enabled": True})
    whole["zero_optimization"] = {"stage": 1}
    whole["bf16"] = {"enabled": True}
    straight = run("whole", whole)
    parts = copy.deepcopy(whole)
    parts["optimus"]["train"]["stop_after_steps"] = 3  # stops at 3, at 6, then finishes at 8
    resumed = run("parts", parts, times=3)
    assert sorted(straight) == list(range(1, 9))
    assert resumed == straight
