import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM, MulaModel
from ds_optimus.hf_models.mula.modeling_mula import MulaExperts, MulaLayerNorm, MulaRMSNorm, MulaTopKRouter

VOCAB = 96


def tiny(**overrides) -> MulaConfig:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
    )
    values.update(overrides)
    return MulaConfig(**values)


def model_for(config, implementation=None) -> MulaForCausalLM:
    model = MulaForCausalLM(config).eval()
    if implementation:
        model.set_experts_implementation(implementation)
    return model


def enable_checkpointing(model, reentrant: bool) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # Transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def ids(batch=2, length=10):
    return torch.randint(2, VOCAB, (batch, length))


# -- losses -----------------------------------------------------------------------------------------
def test_loss_is_lm_plus_weighted_router_losses():
    config = tiny(router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    model = model_for(config).train()
    x = ids()
    out = model(x, labels=x)
    expected_lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.lm_loss, expected_lm)
    torch.testing.assert_close(out.loss, out.lm_loss + 0.01 * out.aux_loss + 0.001 * out.z_loss)
    assert out.aux_loss.item() >= 1.0 - 1e-6  # E * sum f_e p_e >= 1 when p is the mean of the same routing
    assert out.z_loss.item() > 0
    # token-slot counts per MoE layer: every token sends exactly k slots
    assert out.tokens_per_expert.shape == (2, 4)
    assert torch.equal(out.tokens_per_expert.sum(-1), torch.full((2,), 2 * 10 * 2.0))


def test_eval_loss_is_the_lm_loss():
    model = model_for(tiny())
    x = ids()
    out = model(x, labels=x)
    assert out.aux_loss is not None and out.z_loss is not None
    assert torch.equal(out.loss, out.lm_loss)


def test_router_losses_take_their_share_under_trainer_token_normalisation():
    # With num_items_in_batch (Transformers' Trainer, gradient accumulation over several ranks) the LM
    # loss is a sum over this micro-batch divided by the whole batch's label count; the router terms
    # are weighted by this micro-batch's share of those labels.
    model = model_for(tiny(router_aux_loss_coef=0.01, router_z_loss_coef=0.001)).train()
    x = ids(2, 10)
    local = 2 * 9
    out = model(x, labels=x, num_items_in_batch=torch.tensor(4 * local))
    router = 0.01 * out.aux_loss + 0.001 * out.z_loss
    torch.testing.assert_close(out.loss, out.lm_loss + router / 4)
    plain = model(x, labels=x)
    torch.testing.assert_close(out.lm_loss * 4, plain.lm_loss)  # the LM part follows the same rule


def test_router_losses_match_their_definitions():
    config = tiny(num_hidden_layers=1)
    model = model_for(config)
    x = ids(1, 12)
    out = model(x, labels=x, output_router_logits=True)
    logits = out.router_logits[0].float()
    probs = logits.softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    frac = F.one_hot(chosen, 4).sum(1).float().mean(0) / 2
    torch.testing.assert_close(out.aux_loss, 4 * (frac * probs.mean(0)).sum())
    torch.testing.assert_close(out.z_loss, torch.logsumexp(logits, -1).pow(2).mean())


def test_aux_losses_train_the_router():
    model = model_for(tiny()).train()
    x = ids()
    out = model(x, labels=x)
    (out.aux_loss + out.z_loss).backward()
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    assert model.lm_head.weight.grad is None  # the router losses do not reach the head


def test_padding_is_left_out_of_router_losses():
    model = model_for(tiny())
    x = ids(1, 8)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    padded = model(x, attention_mask=mask, output_router_logits=True)
    # the same real tokens with other padding contents give the same losses
    x2 = x.clone()
    x2[0, :3] = torch.randint(2, VOCAB, (3,))
    padded2 = model(x2, attention_mask=mask, output_router_logits=True)
    torch.testing.assert_close(padded.aux_loss, padded2.aux_loss)
    torch.testing.assert_close(padded.z_loss, padded2.z_loss)
    assert padded.tokens_per_expert.sum() == 5 * 2 * 2  # 5 real tokens, k=2, 2 layers


def test_dense_model_has_no_router_losses():
    model = model_for(tiny(num_experts=0))
    x = ids()
    out = model(x, labels=x)
    assert out.aux_loss is None and out.z_loss is None
    assert torch.equal(out.loss, out.lm_loss)
    assert not any(isinstance(m, MulaExperts) for m in model.modules())


def test_every_nth_layer_is_moe():
    config = tiny(num_hidden_layers=4, moe_layer_freq=2)
    model = model_for(config)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MulaMLP", "MulaSparseMoeBlock", "MulaMLP", "MulaSparseMoeBlock"]
    x = ids()
    out = model(x, labels=x, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.tokens_per_expert.shape == (2, 4)


def test_sigmoid_router_weights_are_normalised():
    router = MulaTopKRouter(tiny(router_scoring_func="sigmoid", num_experts_per_tok=3))
    torch.nn.init.normal_(router.weight)
    _, weights, index = router(torch.randn(7, 32))
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))
    assert index.shape == (7, 3)


def test_norm_topk_prob():
    x = torch.randn(5, 32)
    for norm in (True, False):
        router = MulaTopKRouter(tiny(norm_topk_prob=norm))
        torch.nn.init.normal_(router.weight)
        logits, weights, index = router(x)
        probs = logits.softmax(-1).gather(-1, index)
        torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True) if norm else probs)


# -- experts implementations --------------------------------------------------------------------------
def _naive_experts(experts: MulaExperts, x, index, weights):
    """Token by token, slot by slot: the definition of the MoE output."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(index.shape[1]):
            e = index[t, slot]
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, slot] * (experts.down_proj[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("routing", ["random", "one_hot_expert", "empty_experts"])
def test_reference_experts_match_the_definition(routing):
    config = tiny(num_experts=6, num_experts_per_tok=3)
    experts = MulaExperts(config)
    experts.config._experts_implementation = "eager"
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(9, 32)
    if routing == "random":
        index = torch.stack([torch.randperm(6)[:3] for _ in range(9)])
    elif routing == "one_hot_expert":  # expert 4 in every token's slot 0
        index = torch.stack(
            [torch.cat([torch.tensor([4]), torch.tensor([e for e in (0, 1, 2) if e != 4][:2])]) for _ in range(9)]
        )
    else:  # experts 3, 4, 5 receive nothing
        index = torch.stack([torch.randperm(3) for _ in range(9)])
    weights = torch.rand(9, 3)
    torch.testing.assert_close(experts(x, index, weights), _naive_experts(experts, x, index, weights))


def _experts_forward_backward(implementation, dtype, x, index, weights, seed=1):
    torch.manual_seed(seed)
    config = tiny(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3)
    config._experts_implementation = implementation
    experts = MulaExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    experts.to(dtype)
    x = x.to(dtype).requires_grad_()
    weights = weights.to(dtype).requires_grad_()
    out = experts(x, index, weights)
    out.float().pow(2).sum().backward()
    return [t.float() for t in (out, x.grad, weights.grad, experts.gate_up_proj.grad, experts.down_proj.grad)]


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("implementation", ["ds_optimus", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("routing", ["random", "empty_and_hot"])
def test_experts_implementations_agree_with_the_reference(implementation, dtype, tol, routing):
    tokens = 37  # not a multiple of anything
    x = torch.randn(tokens, 64)
    if routing == "random":
        index = torch.stack([torch.randperm(8)[:3] for _ in range(tokens)])
    else:  # every token uses expert 5; experts 0, 1, 2 receive nothing
        index = torch.stack([torch.cat([torch.tensor([5]), 3 + torch.randperm(2)]) for _ in range(tokens)])
    weights = torch.rand(tokens, 3)
    ref = _experts_forward_backward("eager", dtype, x, index, weights)
    got = _experts_forward_backward(implementation, dtype, x, index, weights)
    for name, a, b in zip(("output", "d_input", "d_weights", "d_gate_up", "d_down"), got, ref, strict=True):
        assert _rel_err(a, b) <= tol, (name, _rel_err(a, b))


def test_whole_model_agrees_across_experts_implementations():
    config = tiny(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3)
    x = ids(3, 16)
    results = []
    for impl in ("eager", "ds_optimus", "grouped_mm", "batched_mm"):
        torch.manual_seed(1)
        model = model_for(config, impl).train()
        out = model(x, labels=x)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_default_experts_implementation_is_the_ds_optimus_layer():
    model = MulaForCausalLM(tiny())  # ds_optimus is imported, so its layer is registered
    assert model.config._experts_implementation == "ds_optimus"
    explicit = MulaForCausalLM._from_config(tiny(), experts_implementation="grouped_mm")
    assert explicit.config._experts_implementation == "grouped_mm"


# -- DeepSeek-V3 style bias balancing --------------------------------------------------------------------
def test_selection_bias_changes_choice_not_weights():
    router = MulaTopKRouter(tiny(router_bias_update_rate=0.001))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(20, 32)
    logits, weights, _ = router(x)
    router.expert_bias[3] = 10.0
    logits2, weights2, index2 = router(x)
    assert (index2 == 3).any(-1).all()  # the biased expert is chosen by every token
    torch.testing.assert_close(weights2, logits2.softmax(-1).gather(-1, index2))


def test_bias_updates_balance_the_load():
    config = tiny(router_bias_update_rate=0.001, num_experts=8, num_experts_per_tok=2)
    router = MulaTopKRouter(config).train()
    u = F.normalize(torch.randn(32), dim=0)
    x = torch.randn(512, 32) + u  # tokens lean towards a direction ...
    with torch.no_grad():
        router.weight.normal_(std=0.2)
        router.weight[0] += u  # ... that expert 0 is aligned with

    def imbalance():
        counts = torch.bincount(router(x)[2].reshape(-1), minlength=8).float()
        return (counts.max() / counts.mean()).item()

    before = imbalance()
    history = []
    for _ in range(200):
        router.record_load(router(x)[2])
        router.update_bias(config.router_bias_update_rate)
        history.append(imbalance())
    assert before > 1.5
    assert max(history[-20:]) < 1.1, history[-20:]
    assert router.expert_bias[0] == router.expert_bias.min() and router.expert_bias[0] < 0


def test_router_bias_is_saved_and_loaded(tmp_path):
    model = model_for(tiny(router_bias_update_rate=0.001))
    model.train()
    x = ids()
    model(x)
    model.update_router_bias()
    biases = [layer.mlp.gate.expert_bias.clone() for layer in model.model.layers]
    assert any(b.abs().sum() > 0 for b in biases)
    assert all(layer.mlp.gate.load_since_update.sum() == 0 for layer in model.model.layers)
    assert "load_since_update" not in str(list(model.state_dict()))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for layer, bias in zip(loaded.model.layers, biases, strict=True):
        torch.testing.assert_close(layer.mlp.gate.expert_bias, bias)


def test_load_is_counted_once_per_forward_under_checkpointing():
    model = MulaForCausalLM(tiny(router_bias_update_rate=0.001)).train()
    enable_checkpointing(model, reentrant=False)
    x = ids(2, 10)
    model(x, labels=x).loss.backward()  # the backward pass recomputes each layer's forward
    for layer in model.model.layers:
        assert layer.mlp.gate.load_since_update.sum() == 2 * 10 * 2
    model.eval()
    model(x)  # evaluation does not count
    assert model.model.layers[0].mlp.gate.load_since_update.sum() == 2 * 10 * 2


def test_router_bias_stays_float32_in_a_bfloat16_model(tmp_path):
    model = model_for(tiny(router_bias_update_rate=0.001))
    for layer in model.model.layers:
        layer.mlp.gate.expert_bias.fill_(0.7)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    gate = loaded.model.layers[0].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.expert_bias.dtype == torch.float32
    loaded.train()
    loaded(ids())
    before = gate.expert_bias.clone()
    loaded.update_router_bias()
    steps = (gate.expert_bias - before).abs()
    torch.testing.assert_close(steps, torch.full_like(steps, 0.001))  # below bf16's resolution near 0.7


def test_update_router_bias_requires_a_rate():
    with pytest.raises(ValueError, match="router_bias_update_rate"):
        model_for(tiny()).update_router_bias()


def test_a_router_bias_rate_needs_moe_layers():
    with pytest.raises(
        ValueError,
        match=r"^invalid MulaConfig: router_bias_update_rate 0.01 needs MoE layers, "
        r"but num_experts is 0 \(nothing has a router bias\)$",
    ):
        tiny(num_experts=0, router_bias_update_rate=0.01)


class _CountHostSyncs(TorchDispatchMode):
    """Counts device-to-host reads of tensor values (`.item()`, `bool(tensor)`, `if tensor:` ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def test_update_router_bias_makes_no_host_sync_and_one_all_reduce(monkeypatch):
    """Three MoE layers on a 1-process gloo group: one all-reduce carries every layer's load, nothing
    reads a value back to the host, and the biases move as the per-layer rule says; an update after
    nothing was counted leaves them where they are."""
    import torch.distributed as dist

    rate = 0.001
    model = MulaForCausalLM(tiny(num_hidden_layers=3, router_bias_update_rate=rate)).train()
    routers = [layer.mlp.gate for layer in model.model.layers]
    model(ids(4, 12))
    loads = [r.load_since_update.clone() for r in routers]
    assert all(load.sum() == 4 * 12 * 2 for load in loads)
    expected = [rate * torch.sign(load.mean() - load) for load in loads]

    reductions, tolists = [], []
    real_all_reduce, real_tolist = dist.all_reduce, torch.Tensor.tolist
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, *a, **k: reductions.append(t.numel()) or real_all_reduce(t, *a, **k)
    )
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolists.append(1) or real_tolist(t))  # not dispatched
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with _CountHostSyncs() as counter:
            model.update_router_bias()
        after_first = [r.expert_bias.clone() for r in routers]
        with _CountHostSyncs() as quiet:
            model.update_router_bias()  # nothing counted since: no change
        with _CountHostSyncs() as control:
            bool(torch.ones(()) > 0)
    finally:
        dist.destroy_process_group()
    assert control.syncs == 1  # the counter sees a host sync when there is one
    assert counter.syncs == quiet.syncs == 0 and tolists == []
    assert reductions == [3 * 4, 3 * 4]  # one all-reduce of the three layers' loads, per update
    for router, bias, step in zip(routers, after_first, expected, strict=True):
        torch.testing.assert_close(bias, step)
        torch.testing.assert_close(router.expert_bias, bias)
        assert router.load_since_update.sum() == 0


def test_experts_declare_what_expert_parallelism_sets():
    experts = MulaExperts(tiny())
    assert (experts.num_local_experts, experts.expert_parallel, experts.expert_groups, experts.experts_backend) == (
        4,
        None,
        None,
        None,
    )
    assert MulaForCausalLM(tiny()).router_loss_group is None


def test_save_pretrained_refuses_experts_sharded_over_ranks(tmp_path):
    """Experts cut to 2 of 4 (as expert parallelism over two ranks leaves them): saving would write
    weights that do not match the config, so it is a one-line refusal, unless a state_dict with
    every expert is given."""
    model = model_for(tiny())
    full = model.state_dict()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[:2].clone())
        experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[:2].clone())
        experts.num_local_experts = 2
    message = (
        "save_pretrained: model.layers.0.mlp.experts holds 2 of its 4 experts (expert-parallel); "
        "export on every rank with ds_optimus.parallel.export_pretrained(model, folder)"
    )
    with pytest.raises(ValueError) as refused:
        model.save_pretrained(tmp_path / "sharded")
    assert str(refused.value) == message and not (tmp_path / "sharded").exists()
    with pytest.raises(ValueError, match="holds 2 of its 4 experts"):
        model.save_pretrained(tmp_path / "sharded", state_dict=model.state_dict())
    model.save_pretrained(tmp_path / "full", state_dict=full)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    assert loaded.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 4


# -- generation, checkpointing, dtype, save/load --------------------------------------------------------
def test_generate_with_kv_cache_matches_full_recompute():
    model = model_for(tiny())
    x = ids(2, 6)
    cached = model.generate(x, max_new_tokens=8, do_sample=False, use_cache=True, eos_token_id=None)
    uncached = model.generate(x, max_new_tokens=8, do_sample=False, use_cache=False, eos_token_id=None)
    assert torch.equal(cached, uncached)
    manual = x
    for _ in range(8):
        nxt = model(manual).logits[:, -1].argmax(-1, keepdim=True)
        manual = torch.cat([manual, nxt], dim=1)
    assert torch.equal(cached, manual)


def test_the_cache_under_either_name_continues_the_sequence():
    """Transformers 5.24 renamed the cache `past_key_values` -> `cache`: Mula takes both, returns it under
    the installed version's name, warns about the old one where it is the old one, refuses both at once."""
    from ds_optimus.hf_models.mula.modeling_mula import CACHE_NAME

    model = model_for(tiny())
    x = ids(2, 7)
    full = model(x).logits[:, -1]

    def step(name):
        first = model(x[:, :-1], use_cache=True)
        cache = getattr(first, CACHE_NAME)
        assert cache is not None and cache.get_seq_length() == 6
        return model(x[:, -1:], use_cache=True, **{name: cache}), cache

    new, _ = step("cache")
    torch.testing.assert_close(new.logits[:, -1], full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old, cache = step("past_key_values")
    torch.testing.assert_close(old.logits[:, -1], full)
    assert getattr(old, CACHE_NAME) is cache and cache.get_seq_length() == 7
    deprecated = [w for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)]
    assert len(deprecated) == (1 if CACHE_NAME == "cache" else 0)
    other = model(x[:, :-1], use_cache=True)
    with pytest.raises(ValueError, match="Both `past_key_values` and `cache` are set"):
        model(x[:, -1:], cache=cache, past_key_values=getattr(other, CACHE_NAME))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    config = tiny()
    x = ids()
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(3)
        model = MulaForCausalLM(config).train()
        if checkpointing:
            enable_checkpointing(model, reentrant)
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        out = model(x, labels=x)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], grad, msg=name)
    assert grads[1][1]["model.layers.0.mlp.gate.weight"].abs().sum() > 0


def test_save_and_load_through_the_auto_classes(tmp_path):
    model = model_for(tiny(tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "modeling_mula.py").is_file() and (tmp_path / "configuration_mula.py").is_file()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "mula"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MulaForCausalLM
    x = ids()
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is MulaModel
    torch.testing.assert_close(base(x).last_hidden_state, model.model(x).last_hidden_state, rtol=0, atol=0)


def test_tied_embeddings_share_storage_after_loading(tmp_path):
    model = model_for(tiny(tie_word_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


def test_bfloat16_and_device_map_loading(tmp_path):
    model = model_for(tiny())
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu")
    assert loaded.dtype == torch.bfloat16
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    x = ids()
    out = loaded(x, labels=x)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    ref = model(x).logits
    assert (out.logits.float() - ref).abs().max() / ref.abs().max() < 5e-2


def test_hidden_states_and_attentions_outputs():
    config = tiny()
    config._attn_implementation = "eager"
    model = MulaForCausalLM(config).eval()
    x = ids(1, 7)
    out = model(x, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (1, 4, 7, 7)
    sdpa = MulaForCausalLM(tiny()).eval()
    sdpa.load_state_dict(model.state_dict())
    torch.testing.assert_close(sdpa(x).logits, out.logits, rtol=1e-5, atol=1e-5)


def test_return_tuple():
    model = model_for(tiny())
    x = ids()
    loss, *rest = model(x, labels=x, return_dict=False)
    assert torch.isfinite(loss) and len(rest) > 0


# -- norms ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "norm_type, affine, per_norm",
    [
        ("rms_norm", True, ["weight"]),
        ("rms_norm", False, []),
        ("layer_norm", True, ["bias", "weight"]),
        ("layer_norm", False, []),
    ],
)
def test_every_norm_but_qk_norm_follows_the_config(norm_type, affine, per_norm):
    model = model_for(tiny(norm_type=norm_type, norm_elementwise_affine=affine))
    want = MulaLayerNorm if norm_type == "layer_norm" else MulaRMSNorm
    norms = [model.model.norm] + [
        n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    assert all(type(n) is want for n in norms)
    for norm in norms:
        assert sorted(name for name, _ in norm.named_parameters()) == per_norm
    attn = model.model.layers[0].self_attn  # QK-norm stays an RMSNorm with a weight, as in OLMoE
    assert type(attn.q_norm) is MulaRMSNorm and attn.q_norm.weight is not None
    norm_keys = {k for k in model.state_dict() if "layernorm" in k or k.startswith("model.norm")}
    assert len(norm_keys) == len(per_norm) * len(norms)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_pytorchs_computed_in_float32(affine):
    norm = MulaLayerNorm(16, eps=1e-5, elementwise_affine=affine)
    reference = torch.nn.LayerNorm(16, eps=1e-5, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            for ours, theirs in ((norm.weight, reference.weight), (norm.bias, reference.bias)):
                ours.normal_()
                theirs.copy_(ours)
    x = torch.randn(3, 5, 16) * 4 + 2
    assert torch.equal(norm(x), reference(x))
    # bfloat16 in, bfloat16 out, computed in float32 (with the bfloat16 weights): the float32 result rounded once
    out = norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    rounded = reference.to(torch.bfloat16).float()
    assert torch.equal(out, rounded(x.to(torch.bfloat16).float()).to(torch.bfloat16))


def test_rms_norm_without_affine_is_the_normalised_input():
    x = torch.randn(4, 8)
    out = MulaRMSNorm(8, eps=1e-5, elementwise_affine=False)(x)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), rtol=0, atol=0)


def test_init_weights_sets_affine_norms_to_ones_and_zeros():
    model = MulaForCausalLM(tiny(norm_type="layer_norm"))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    for module in model.modules():
        module._is_hf_initialized = False
    for p in model.parameters():
        p._is_hf_initialized = False
    model.apply(model._init_weights)
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            assert torch.equal(norm.weight, torch.ones(32)) and torch.equal(norm.bias, torch.zeros(32))
    assert torch.equal(model.model.norm.weight, torch.ones(32)) and torch.equal(model.model.norm.bias, torch.zeros(32))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_model_saves_and_loads(tmp_path, affine):
    model = model_for(tiny(norm_type="layer_norm", norm_elementwise_affine=affine))
    if affine:
        with torch.no_grad():
            model.model.norm.bias.normal_()  # a trained value, which loading must restore
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (loaded.config.norm_type, loaded.config.norm_elementwise_affine) == ("layer_norm", affine)
    x = ids()
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(norm_type="group_norm"), "norm_type must be one of 'rms_norm', 'layer_norm', got 'group_norm'"),
        (dict(norm_elementwise_affine="yes"), "norm_elementwise_affine must be true or false, got 'yes'"),
    ],
)
def test_norm_fields_are_checked_in_one_line(overrides, message):
    with pytest.raises(ValueError) as err:
        tiny(**overrides)
    assert str(err.value) == f"invalid MulaConfig: {message}"
