"""`ParallelDims`: the one layout the trainer, `--check` and the planner share."""

import itertools

import pytest

from ds_optimus.config import OptimusConfig
from ds_optimus.parallel.dims import LayoutError, ParallelDims, RankPosition
from ds_optimus.plan.cluster import get_cluster
from ds_optimus.plan.configs import layout_config
from ds_optimus.plan.model import ModelShape
from ds_optimus.plan.search import candidate_layouts
from ds_optimus.schema import ConfigError


@pytest.mark.parametrize("world, pp, tp, ep", [(16, 1, 2, 4), (24, 2, 2, 3), (8, 4, 1, 2), (12, 1, 3, 1)])
def test_every_rank_has_one_position_and_ranks_are_laid_out_stage_then_dp_then_tp(world, pp, tp, ep):
    dims = ParallelDims(world, pp=pp, tp=tp, ep=ep)
    positions = [dims.position(rank) for rank in range(world)]
    # a bijection onto stages x data-parallel ranks x TP ranks, counted in that order (TP innermost)
    cells = [(p.stage, p.dp_rank, p.tp_rank) for p in positions]
    assert cells == list(itertools.product(range(pp), range(dims.dp), range(tp)))
    # EP groups are runs of `ep` consecutive data-parallel ranks; the ranks holding one set of experts: edp
    assert all(p.ep_rank == p.dp_rank % ep for p in positions)
    assert dims.edp * ep == dims.dp == world // (pp * tp)
    assert positions[world - 1] == RankPosition(stage=pp - 1, tp_rank=tp - 1, dp_rank=dims.dp - 1, ep_rank=ep - 1)


def _opt(**optimus):
    return OptimusConfig.from_ds_config({"optimus": optimus})


@pytest.mark.parametrize(
    "optimus, world, message",
    [
        ({"pipeline_parallel": {"size": 4}}, 2, "optimus.pipeline_parallel.size 4 does not divide the 2 ranks"),
        ({"tensor_parallel": {"size": 4}}, 2, "optimus.tensor_parallel.size 4 does not divide the 2 ranks"),
        (
            {"pipeline_parallel": {"size": 2}, "tensor_parallel": {"size": 4}},
            4,
            "optimus.tensor_parallel.size 4 does not divide the 2 ranks of each pipeline stage",
        ),
        (
            {"tensor_parallel": {"size": 2}, "sharded_optimizer": {"enabled": False}},
            2,
            "optimus.tensor_parallel needs optimus.sharded_optimizer.enabled true",
        ),
    ],
)
def test_a_layout_that_does_not_fit_is_one_line_naming_the_key(optimus, world, message):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(_opt(**optimus), world)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_expert_parallelism_is_checked_against_the_model():
    dims = ParallelDims.from_config(_opt(pipeline_parallel={"size": 2}, expert_parallel={"size": 2}), 2)
    with pytest.raises(LayoutError, match="^expert parallel size 2 does not divide the 1 ranks of each of the 2 pipel"):
        dims.check_experts(8)
    dims = ParallelDims(8, ep=4)
    dims.check_experts(8)  # fits
    with pytest.raises(LayoutError, match="does not divide the number of experts 6$"):
        dims.check_experts(6)
    with pytest.raises(ConfigError, match=r"^optimus.expert_parallel.size > 1 needs an MoE model"):
        dims.check_experts(0)
    ParallelDims(8).check_experts(0)  # dense, no EP: fits


@pytest.mark.parametrize("preset, devices", [("mula-7b-a1b", 16), ("mula-1b", 16)])
def test_the_planners_layouts_are_the_dims_the_trainer_builds_from_the_configs_they_write(preset, devices):
    """Each layout the planner proposes, written as a config and read back as the trainer reads it,
    has the planner's sizes (the planner's `Layout.dims` and the trainer's `ParallelDims` are one)."""
    model = ModelShape.from_preset(preset)
    layouts = candidate_layouts(model, get_cluster("h100"), devices, 4 * devices, 2048, tensor=(1, 2, 4))
    one_each = {(la.pp, la.tp, la.ep, la.sp): la for la in layouts}  # one layout of each set of sizes
    assert len(one_each) >= 19 and any(la.sp for la in one_each.values())
    assert preset == "mula-1b" or any(la.ep > 1 and la.pp > 1 and la.tp > 1 for la in one_each.values())
    for layout in one_each.values():
        opt = OptimusConfig.from_ds_config(layout_config(layout, preset, get_cluster("h100")))
        dims = ParallelDims.from_config(opt, devices)
        assert (dims.world, dims.pp, dims.tp, dims.ep, dims.sp) == (
            layout.dims.world,
            layout.pp,
            layout.tp,
            layout.ep,
            layout.sp,
        )
        assert dims.dp == layout.dp
