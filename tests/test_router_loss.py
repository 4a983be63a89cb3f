"""The load-balancing loss in Transformers' form (`router_aux_loss_type="transformers"`, the seed system's)
against Transformers' own `load_balancing_loss_func`, with and without padding, under the global-batch
scope, and through the model."""

import pytest
import torch
from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.hf_models.mula.modeling_mula import router_losses

E, K, LAYERS = 8, 2, 3


def routed(batch: int, seq: int, seed: int = 0) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Random router logits of every layer [batch*seq, E] and the softmax router's top-k choices."""
    gen = torch.Generator().manual_seed(seed)
    logits = tuple(
        torch.randn(batch * seq, E, generator=gen, dtype=torch.float64).float().requires_grad_() for _ in range(LAYERS)
    )
    return logits, tuple(torch.topk(x.softmax(-1), K, dim=-1).indices for x in logits)


@pytest.mark.parametrize("padded", [False, True])
def test_transformers_form_equals_transformers_function(padded):
    logits, chosen = routed(3, 7)
    mask = None
    if padded:
        mask = torch.ones(3, 7, dtype=torch.long)
        mask[0, :4] = 0  # left padding
        mask[2, 5:] = 0  # right padding
    ours, _, counts = router_losses(
        logits, chosen, E, token_mask=None if mask is None else mask.reshape(-1), form="transformers"
    )
    theirs = load_balancing_loss_func(logits, E, K, mask)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    real = 21 if mask is None else int(mask.sum())
    assert counts.sum() == LAYERS * real * K
    # the per-layer form is a different number: about k times smaller at balance
    mula, _, _ = router_losses(logits, chosen, E, token_mask=None if mask is None else mask.reshape(-1))
    assert abs(ours.item() / mula.item() - K) < 0.5 * K


def test_transformers_form_is_k_at_balance():
    # every expert equally likely and equally chosen: E * sum_e (k/E) (1/E) = k
    logits = tuple(torch.zeros(E, E) for _ in range(LAYERS))
    chosen = tuple(torch.stack([torch.arange(E), (torch.arange(E) + 1) % E], dim=-1) for _ in range(LAYERS))
    ours, _, _ = router_losses(logits, chosen, E, form="transformers")
    torch.testing.assert_close(ours, torch.tensor(float(K)))
    mula, _, _ = router_losses(logits, chosen, E)
    torch.testing.assert_close(mula, torch.tensor(1.0))


def test_transformers_form_trains_the_router():
    logits, chosen = routed(2, 5, seed=1)
    ours, _, _ = router_losses(logits, chosen, E, form="transformers")
    theirs = load_balancing_loss_func(logits, E, K)
    ours_grads = torch.autograd.grad(ours, logits)
    theirs_grads = torch.autograd.grad(theirs, logits)
    for mine, reference in zip(ours_grads, theirs_grads, strict=True):
        assert mine.abs().sum() > 0
        torch.testing.assert_close(mine, reference, atol=1e-6, rtol=0)


def test_global_batch_scope_pools_the_ranks_slot_counts(monkeypatch):
    # Two ranks' micro-batches; the all-reduce is stood in for by adding the other rank's counts. The
    # mean of the two ranks' losses is then Transformers' loss over both micro-batches at once.
    (a, chosen_a), (b, chosen_b) = routed(2, 6, seed=2), routed(2, 6, seed=3)
    sent = {}

    def keep(tensor, group=None):
        sent["flat"] = tensor.clone()

    monkeypatch.setattr(torch.distributed, "all_reduce", keep)
    router_losses(b, chosen_b, E, group="dp", form="transformers")
    flat_b = sent["flat"]
    router_losses(a, chosen_a, E, group="dp", form="transformers")
    flat_a = sent["flat"]

    def add(other):
        def all_reduce(tensor, group=None):
            assert group == "dp"
            tensor += other

        return all_reduce

    monkeypatch.setattr(torch.distributed, "all_reduce", add(flat_b))
    loss_a, _, _ = router_losses(a, chosen_a, E, group="dp", form="transformers")
    monkeypatch.setattr(torch.distributed, "all_reduce", add(flat_a))
    loss_b, _, _ = router_losses(b, chosen_b, E, group="dp", form="transformers")
    both = tuple(torch.cat([x, y]) for x, y in zip(a, b, strict=True))
    torch.testing.assert_close((loss_a + loss_b) / 2, load_balancing_loss_func(both, E, K), atol=1e-6, rtol=0)


def test_model_uses_the_configured_form():
    values = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=16,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        router_z_loss_coef=0.0,
    )
    torch.manual_seed(0)
    model = MulaForCausalLM(MulaConfig(**values, router_aux_loss_type="transformers")).train()
    x = torch.randint(2, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    out = model(x, attention_mask=mask, labels=x, output_router_logits=True)
    torch.testing.assert_close(out.aux_loss, load_balancing_loss_func(out.router_logits, E, K, mask), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.loss, out.lm_loss + 0.01 * out.aux_loss)
    out.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="router_aux_loss_type must be 'mula' or 'transformers', got 'olmoe'"):
        MulaConfig(**values, router_aux_loss_type="olmoe")
