"""The all-gather expert-parallel exchange (`optimus.expert_parallel.dispatch: "allgather"`) against
the per-slot all-to-all on 2 and 4 CPU processes (gloo): the MoE layer's output and every gradient
(input, router, experts) agree, with unequal token counts per rank (a rank with none included),
dropped slots, and ranks whose tokens route nowhere locally; its config errors are one line."""

import pytest
from allgather_workers import allgather_against_alltoall
from distributed import run_distributed

from ds_optimus.config import OptimusConfig
from ds_optimus.parallel.expert_parallel import ExpertParallelConfig
from ds_optimus.schema import ConfigError

BF16_ROUNDING = 2.0**-8  # bf16's relative spacing: the rounding of one value


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# One launch per EP size; per case a layer of `experts` experts, top_k, tokens per rank.
LAYER_CASES = {
    2: [
        {"top_k": 2, "tokens": [16, 16]},
        {"top_k": 3, "tokens": [5, 13]},
        {"top_k": 2, "tokens": [9, 4], "bias": [6, 7]},  # rank 0's tokens route nowhere locally
        {"top_k": 3, "tokens": [12, 7], "capacity": 0.5},  # dropped slots (ids -1)
        {"top_k": 2, "tokens": [11, 6], "dtype": "bfloat16"},
        {"top_k": 3, "tokens": [10, 10], "dtype": "bfloat16", "bias": [5, 6, 7]},
    ],
    4: [
        {"top_k": 3, "tokens": [0, 7, 3, 12]},  # a rank without tokens; 2 experts per rank: top-3 > local
        {"top_k": 2, "tokens": [8, 8, 8, 8], "bias": [6, 7]},  # ranks 0-2 route nowhere locally
        {"top_k": 4, "tokens": [6, 9, 2, 5], "capacity": 0.5, "experts": 16},
        {"top_k": 2, "tokens": [10, 3, 7, 5], "dtype": "bfloat16"},
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4], ids=["ep2", "ep4"])
def test_allgather_equals_alltoall(ep):
    """Outputs and every gradient within 1e-6 (fp32) or bf16 rounding (bf16) of the all-to-all's; the
    experts receive exactly the routed rows (padding rows carry no routing), and no all-to-all runs.
    At EP 2 whole tiny Mula models configured through setup_moe agree too (every token on one rank)."""
    cases = LAYER_CASES[ep]
    models = (
        [{"bias": {6: 10.0, 7: 10.0}, "expert_parallel": {"size": 2, "dispatch": d}} for d in ("alltoall", "allgather")]
        if ep == 2
        else []
    )
    results = run_distributed(allgather_against_alltoall, ep, cases, models)
    for rank, result in enumerate(results):
        for case, runs in zip(cases, result["layers"], strict=True):
            a2a, ag = runs["alltoall"], runs["allgather"]
            assert (a2a["dispatcher"], ag["dispatcher"]) == ("ExpertParallelDispatcher", "AllGatherDispatcher")
            assert ag["all_to_alls"] == 0 < a2a["all_to_alls"]
            assert ag["expert_rows"] == a2a["expert_rows"], (rank, case)
            if "bias" in case:
                owner = case["bias"][0] // (case.get("experts", 8) // ep)
                assert (ag["local_slots"] == 0) == (rank != owner)
                assert (ag["expert_rows"] == 0) == (rank != owner)
            # bf16: the output is bitwise the same here; the input's and router's gradients differ by a
            # rounding of the routing weights' gradients (a dot product computed another way), which the
            # softmax's backward amplifies for the router (both stay as far from the fp32 layer)
            tol = 2 * BF16_ROUNDING if case.get("dtype") == "bfloat16" else 1e-6
            assert ag["out"].shape == a2a["out"].shape == (case["tokens"][rank], 32)
            if case["tokens"][rank]:
                assert rel(ag["out"].float(), a2a["out"].float()) <= tol, (rank, case)
            for name, grad in a2a["grads"].items():
                other = ag["grads"][name]
                assert (grad is None) == (other is None), (rank, case, name)
                if grad is not None and grad.numel():
                    assert other.dtype == grad.dtype
                    assert rel(other.float(), grad.float()) <= tol, (rank, case, name)
        if ep == 2:
            per_slot, gathered = result["models"]
            assert gathered["rows_sent"] == 0 < per_slot["rows_sent"]  # setup_moe installed the all-gather
            assert rel(gathered["logits"], per_slot["logits"]) <= 1e-6
            for name, grad in per_slot["grads"].items():
                assert rel(gathered["grads"][name], grad) <= 1e-6, name


def test_allgather_config_errors_are_one_line():
    where = "optimus.expert_parallel"
    parse = ExpertParallelConfig.parse
    assert parse({"size": 4, "dispatch": "allgather", "dedup": "auto"}, where).dispatch == "allgather"
    assert parse({"size": 4, "dispatch": "allgather", "node_size": 4}, where).node_size == 4  # one node
    assert parse({"size": 4}, where).dispatch == "alltoall"
    with pytest.raises(
        ConfigError,
        match=r'^optimus.expert_parallel.dispatch must be "alltoall" or "allgather", '
        r"got 'ring'$",
    ):
        parse({"size": 4, "dispatch": "ring"}, where)
    message = (
        r'^optimus.expert_parallel.dispatch "allgather" is a flat exchange in one chunk without dedup; '
        r"it does not take {}$"
    )
    for given, named in [
        ({"dedup": True}, "optimus.expert_parallel.dedup true"),
        ({"dedup": True, "chunks": 2}, "optimus.expert_parallel.dedup true and optimus.expert_parallel.chunks 2"),
        ({"node_size": 2}, "optimus.expert_parallel.node_size 2"),
    ]:
        with pytest.raises(ConfigError, match=message.format(named)):
            parse({"size": 4, "dispatch": "allgather", **given}, where)
    with pytest.raises(ConfigError, match=message.format("optimus.expert_parallel.chunks 3")):
        OptimusConfig.from_ds_config(
            {"optimus": {"expert_parallel": {"size": 2, "dispatch": "allgather", "chunks": 3}}}
        )


def test_apply_expert_parallel_refuses_allgather_with_dedup_chunks_or_nodes_before_changing_anything():
    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
    from ds_optimus.parallel import apply_expert_parallel

    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe"))
    before = model.model.layers[0].mlp.experts.gate_up_proj
    prefix = r'^apply_expert_parallel: dispatch="allgather" is a flat exchange in one chunk without dedup; '
    for kwargs, named in [
        ({"dedup": True}, "dedup=True"),
        ({"chunks": 2}, "chunks=2"),
        ({"node_size": 2}, "a hierarchical node_size"),
        ({"dedup": True, "node_size": 2}, "dedup=True and a hierarchical node_size"),
    ]:
        with pytest.raises(ValueError, match=prefix + f"it does not take {named}$"):
            apply_expert_parallel(model, 4, dispatch="allgather", **kwargs)
    with pytest.raises(
        ValueError,
        match=r'^apply_expert_parallel: dispatch must be "alltoall" or "allgather", '
        r"got 'all_gather'$",
    ):
        apply_expert_parallel(model, 4, dispatch="all_gather")
    assert model.model.layers[0].mlp.experts.gate_up_proj is before
    assert model.model.layers[0].mlp.experts.expert_parallel is None


def test_allgather_bytes_formula():
    from ds_optimus.parallel.traffic import allgather_sends_fewer_bytes, exchange_bytes_per_token

    # all-gather: (P-1) rows in and out per token, whatever top-k; per slot: k (P-1)/P each way
    assert exchange_bytes_per_token("allgather", 4, 8, row_bytes=100) == 2 * 3 * 100
    assert exchange_bytes_per_token("alltoall", 4, 8, row_bytes=100) == 2 * 8 * 3 / 4 * 100
    assert [allgather_sends_fewer_bytes(8, ep) for ep in (2, 4, 8, 12)] == [True, True, False, False]
    # the seed's EP 12 with top-8: 1.5x the per-slot bytes
    assert exchange_bytes_per_token("allgather", 12, 8, 1.0) / exchange_bytes_per_token(
        "alltoall", 12, 8, 1.0
    ) == pytest.approx(1.5)
