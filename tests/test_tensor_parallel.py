"""Tensor parallelism (`ds_optimus.parallel.tensor_parallel`): a Mula model split over 2 gloo processes
computes the whole model's loss and gradients (each rank's slice of every split gradient), holds 1/T
of every split weight, splits what its family's plan names, and a width that does not divide is a one-line error."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.parallel.tensor_parallel import TensorParallelError, apply_tensor_parallel


def _config(preset: str, **overrides) -> MulaConfig:
    config = MulaConfig.from_preset(preset, **overrides)
    config._attn_implementation = "eager"
    return config


def split_worker(rank: int, world: int, preset: str, overrides: dict) -> dict:
    """The whole model and its split copy on the same batch: losses, and for every parameter the largest
    difference between this rank's gradient and its slice of the whole model's."""
    torch.manual_seed(0)
    config = _config(preset, **overrides)
    whole = MulaForCausalLM(config)
    split = copy.deepcopy(whole)
    splits = apply_tensor_parallel(split, dist.group.WORLD)
    ids = torch.randint(2, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ids[0, -4:] = -100  # ignored labels count in neither loss
    inputs = ids.clamp(min=0)
    expected = whole(input_ids=inputs, labels=ids)
    got = split(input_ids=inputs, labels=ids)
    expected.loss.backward()
    got.loss.backward()
    reference = dict(whole.named_parameters())
    worst, held, total = {}, 0, 0
    for name, param in split.named_parameters():
        grad = reference[name].grad
        if name in splits:
            s = splits[name]
            grad = grad.narrow(s.dim, s.start, s.stop - s.start)
            held += param.numel()
            total += reference[name].numel()
        assert param.grad.shape == grad.shape, name
        worst[name] = (param.grad - grad).abs().max().item() / max(grad.abs().max().item(), 1e-30)
    return {
        "loss": got.loss.item(),
        "expected": expected.loss.item(),
        "logits": got.logits.shape[-1],
        "worst": worst,
        "held": held,
        "total": total,
        "splits": sorted(splits),
    }


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("mula-tiny-dense", {}),
        ("mula-tiny-moe", {"attention_bias": True}),
    ],
    ids=["dense-tied", "moe-untied-bias"],
)
def test_two_tensor_parallel_ranks_compute_the_whole_models_loss_and_gradients(preset, overrides):
    """float32: the split sums a matmul's products in two halves, so the loss agrees to a few float32
    roundings (rel 1e-5) and each gradient to 1e-4 of its largest element."""
    first, second = run_distributed(split_worker, 2, preset, overrides)
    for result in (first, second):
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-5)
        bad = {name: diff for name, diff in result["worst"].items() if diff > 1e-4}
        assert not bad, bad
        assert result["held"] * 2 == result["total"]  # each rank keeps half of every split weight
    assert first["loss"] == second["loss"]
    assert first["logits"] == 4096 // 2  # each rank's vocabulary slice: the full logits exist nowhere
    names = first["splits"]
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.o_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "model.layers.0.self_attn.q_norm.weight" in names
    if preset == "mula-tiny-moe":
        # the router and the experts are replicated over the group, their gradients compared whole
        replicated = ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj")
        assert "lm_head.weight" in names and not set(replicated) & set(names)
        assert set(replicated) <= set(first["worst"])


def test_widths_that_do_not_divide_are_one_line_errors():
    model = MulaForCausalLM(_config("mula-tiny-dense"))  # 2 key/value heads, 4 query heads
    with pytest.raises(TensorParallelError, match=r"^tensor parallel size 4 does not divide the key/value heads \(2\)"):
        apply_tensor_parallel(copy.deepcopy(model), None, size=4, rank=0)
    with pytest.raises(TensorParallelError, match=r"^tensor parallel size 3 does not divide the key/value heads"):
        apply_tensor_parallel(copy.deepcopy(model), None, size=3, rank=0)
    odd = MulaForCausalLM(_config("mula-tiny-dense", vocab_size=4097))
    with pytest.raises(TensorParallelError, match=r"^tensor parallel size 2 does not divide the vocabulary \(4097\)$"):
        apply_tensor_parallel(odd, None, size=2, rank=0)


def test_the_split_follows_the_models_plan_and_a_family_without_one_is_a_one_line_error(monkeypatch):
    """What is split is what Mula's plan names, found by pattern: drop the MLP's entries and the dense
    MLPs stay whole; every entry of the plan names a module of some preset (none is stale); an unknown
    style and a family without a plan are one-line errors."""
    from ds_optimus.hf_models.mula import parallelize
    from ds_optimus.parallel import tensor_parallel

    named = {"mula-tiny-dense": set(), "mula-tiny-moe": set()}
    for preset in named:
        model = MulaForCausalLM(_config(preset, num_hidden_layers=2, tie_word_embeddings=False))
        splits = apply_tensor_parallel(model, None, size=2, rank=0)
        named[preset] = {
            pattern for pattern in parallelize.TENSOR_PARALLEL_PLAN for name in splits if _matches(pattern, name)
        }
    assert set().union(*named.values()) == set(parallelize.TENSOR_PARALLEL_PLAN)
    fewer = {k: v for k, v in parallelize.TENSOR_PARALLEL_PLAN.items() if ".mlp." not in k}
    monkeypatch.setattr(parallelize, "TENSOR_PARALLEL_PLAN", fewer)
    model = MulaForCausalLM(_config("mula-tiny-dense", num_hidden_layers=2))
    splits = apply_tensor_parallel(model, None, size=2, rank=0)
    assert "model.layers.0.self_attn.q_proj.weight" in splits and not any(".mlp." in name for name in splits)
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    monkeypatch.setattr(parallelize, "TENSOR_PARALLEL_PLAN", {"lm_head": ("diagonal", "the vocabulary")})
    with pytest.raises(
        TensorParallelError, match=r"^lm_head: no tensor-parallel style 'diagonal' \(the styles: column,"
    ):
        apply_tensor_parallel(MulaForCausalLM(_config("mula-tiny-dense")), None, size=2, rank=0)
    monkeypatch.delitem(tensor_parallel.PLANS, "mula")
    with pytest.raises(TensorParallelError, match=r"^tensor parallelism has no plan for 'mula' models \(it has: \)$"):
        apply_tensor_parallel(MulaForCausalLM(_config("mula-tiny-dense")), None, size=2, rank=0)


def _matches(pattern: str, parameter: str) -> bool:
    """Whether a parameter's name is of a module `pattern` names."""
    want, have = pattern.split("."), parameter.split(".")[:-1]
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True))


def build_worker(rank: int, world: int, preset: str) -> dict:
    """`build_model` with this rank's tensor-parallel part, on the meta device first: every parameter is
    this rank's slice of what the whole model gets from the same seed."""
    from ds_optimus.parallel.build import build_model

    config = _config(preset)
    whole = dict(build_model(config, seed=7).named_parameters())
    part = build_model(config, seed=7, tensor_parallel=(dist.group.WORLD, world, rank))
    differ, kept = [], 0
    for name, param in part.named_parameters():
        full = whole[name]
        if param.shape != full.shape:
            dim = next(d for d in range(full.dim()) if param.shape[d] != full.shape[d])
            full = full.narrow(dim, rank * param.shape[dim], param.shape[dim])
            kept += param.numel()
        if not torch.equal(param, full):
            differ.append(name)
    tied = part.lm_head.weight is part.model.embed_tokens.weight
    return {"differ": differ, "kept": kept, "tied": tied}


@pytest.mark.parametrize("preset", ["mula-tiny-dense", "mula-tiny-moe"])
def test_a_tensor_parallel_build_holds_its_slice_of_the_whole_models_initial_values(preset):
    results = run_distributed(build_worker, 2, preset)
    for result in results:
        assert result["differ"] == [] and result["kept"] > 0
        assert result["tied"] == (preset == "mula-tiny-dense")


def folder_worker(rank: int, world: int, folder: str) -> dict:
    """A saved whole model read into this rank's tensor-parallel part: each tensor its slice (a
    row-split weight read by rows, a column-split one cut after the read)."""
    from ds_optimus.parallel.build import build_model

    config = MulaConfig.from_pretrained(folder)
    whole = dict(MulaForCausalLM.from_pretrained(folder).named_parameters())
    part = build_model(config, folder=folder, tensor_parallel=(dist.group.WORLD, world, rank))
    differ = []
    for name, param in part.named_parameters():
        full = whole[name]
        if param.shape != full.shape:
            dim = next(d for d in range(full.dim()) if param.shape[d] != full.shape[d])
            full = full.narrow(dim, rank * param.shape[dim], param.shape[dim])
        if not torch.equal(param, full):
            differ.append(name)
    return differ


def test_a_tensor_parallel_build_reads_its_slices_from_a_folder(tmp_path):
    torch.manual_seed(3)
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", attention_bias=True))
    model.save_pretrained(tmp_path / "m")
    assert run_distributed(folder_worker, 2, str(tmp_path / "m")) == [[], []]


def test_the_docs_example_runs_as_written(tmp_path):
    """docs/parallelism.md's two-process example, through torchrun, prints what the page says."""
    import re
    import subprocess
    import sys

    from doc_blocks import ROOT, doc_block

    script = tmp_path / "tp_example.py"
    script.write_text(doc_block("## The split on its own", "python"))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = sorted(re.findall(r"rank (\d): loss ([\d.]+), embedding rows held (\d+)", done.stdout))
    shown = re.search(
        r"prints `rank 0: loss ([\d.]+), embedding rows held (\d+)` and the same for rank 1",
        (ROOT / "docs" / "parallelism.md").read_text(),
    )
    assert shown and [(rank, rows) for rank, _, rows in said] == [("0", shown.group(2)), ("1", shown.group(2))]
    # the page rounds to 1e-4; another CPU's float32 sums may move the fifth decimal
    assert all(abs(float(loss) - float(shown.group(1))) <= 2e-4 for _, loss, _ in said), said


def export_worker(rank: int, world: int, folder: str) -> dict | None:
    """Rank 0 writes the whole model from the two ranks' parts as an ordinary folder."""
    from ds_optimus.parallel.build import build_model
    from ds_optimus.parallel.tensor_parallel import whole_tensors

    config = _config("mula-tiny-moe")
    part = build_model(config, seed=5)
    splits = apply_tensor_parallel(part, dist.group.WORLD)
    state = {name: tensor.clone() for name, tensor in whole_tensors(part, splits, dist.group.WORLD)}
    if rank:
        return None
    whole = build_model(config, seed=5)
    reference = whole.state_dict()
    differ = sorted(set(state) ^ set(reference))
    differ += [k for k in state if k in reference and not torch.equal(state[k], reference[k])]
    whole.save_pretrained(folder, state_dict=state)
    return {"same": not differ, "differ": differ[:5]}


def test_the_parts_join_into_the_whole_models_folder(tmp_path):
    first, second = run_distributed(export_worker, 2, str(tmp_path / "m"))
    assert first == {"same": True, "differ": []} and second is None
    loaded = MulaForCausalLM.from_pretrained(tmp_path / "m")
    from ds_optimus.parallel.build import build_model

    expected = build_model(_config("mula-tiny-moe"), seed=5).state_dict()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())


class _FakeSpace:
    """One parameter's shard as a sharded-optimizer space holds it: a TP rank's part [start, stop) along
    `dim` of the whole 2-D tensor `whole`, of which this DP rank owns local elements [lo, hi); its state
    the whole tensor's values there (or zeros, to be loaded)."""

    def __init__(self, whole: torch.Tensor, dim: int, start: int, stop: int, lo: int, hi: int, fill: bool):
        from ds_optimus.optim.sharded import ShardedOptimizer
        from ds_optimus.optim.spaces import Space
        from ds_optimus.parallel.tensor_parallel import Split

        self.key, self.names, self.replica_rank, self.lo, self.hi = "tensor:float32", ["w"], 0, lo, hi
        owner = type("Owner", (), {"tensor_splits": {"w": Split(tuple(whole.shape), dim, start, stop)}})()
        offset, columns = ShardedOptimizer._place(owner, "w")
        self.offsets, self.columns = [offset], [columns]
        self.pieces = Space.pieces.__get__(self)
        # the whole tensor's flat index of each element, in this shard's order
        self.indices = torch.arange(whole.numel()).view(whole.shape).narrow(dim, start, stop - start).reshape(-1)[lo:hi]
        self.elements = set(self.indices.tolist())
        part = whole.narrow(dim, start, stop - start).reshape(-1)[lo:hi]
        for i, key in enumerate(("master", "exp_avg", "exp_avg_sq")):
            setattr(self, key, part + i if fill else torch.zeros_like(part))

    def own_runs(self):
        yield 0, self.lo, self.hi - self.lo, 0


def _layout(whole: torch.Tensor, dim: int, tp: int, dp: int, fill: bool) -> list[_FakeSpace]:
    """Every rank's space of a TP x DP layout: each TP part cut over `dp` ranks in unequal runs."""
    spaces, size, numel = [], whole.shape[dim] // tp, whole.numel() // tp
    cuts = [0, *sorted({(numel * k) // dp + (k % 2) for k in range(1, dp)}), numel]
    for t in range(tp):
        spaces += [_FakeSpace(whole, dim, t * size, (t + 1) * size, a, b, fill) for a, b in itertools.pairwise(cuts)]
    return spaces


@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "columns"])
def test_optimizer_state_saved_at_one_tensor_parallel_size_loads_at_another(dim):
    """The sharded optimizer's pieces are in the whole tensor's coordinates (a column part's as one
    segment per row): state saved at TP 1, 2 and 4 over 1 and 3 data-parallel ranks each loads into
    every other layout, every element from where the whole tensor has it, and the manifest's ranges
    name exactly the files that hold a rank's elements."""
    from ds_optimus.optim.shard_state import files_holding, held_ranges, load_spaces, shard_state

    whole = torch.arange(12 * 16, dtype=torch.float32).reshape(12, 16)
    layouts = [(tp, dp) for tp in (1, 2, 4) for dp in (1, 3)]
    for saved_layout in layouts:
        spaces = _layout(whole, dim, *saved_layout, fill=True)
        saved = [{"format": "ds_optimus.sharded/1", "spaces": shard_state([space])} for space in spaces]
        held = {i: held_ranges(state) for i, state in enumerate(saved)}
        for layout in layouts:
            for space in _layout(whole, dim, *layout, fill=False):
                needed = files_holding(held, [space])
                assert needed == [i for i, other in enumerate(spaces) if other.elements & space.elements]
                load_spaces([space], [saved[i] for i in needed])
                for i, key in enumerate(("master", "exp_avg", "exp_avg_sq")):
                    expected = whole.reshape(-1)[space.indices] + i
                    assert torch.equal(getattr(space, key), expected), (saved_layout, layout, key)


def test_every_rank_gets_its_groups_with_tensor_parallelism_innermost(monkeypatch):
    """16 ranks as TP 2 x (DP 8 = EP 4 x EDP 2), the EP groups hierarchical over nodes of 2 (of one TP
    position's ranks): each rank's TP group is its pair, its DP/EP/EDP/intra/inter groups are made over its TP
    position's ranks, and its experts' group across TP positions joins both positions' EDP groups (made on a
    stand-in of torch.distributed that records the ranks of every group)."""
    from types import SimpleNamespace

    from ds_optimus.parallel import groups as G
    from ds_optimus.parallel.dims import ParallelDims, RankPosition

    world = 16
    for rank in range(world):
        fake = SimpleNamespace(
            is_available=lambda: True,
            is_initialized=lambda: True,
            get_world_size=lambda group=None: world,
            get_rank=lambda group=None, r=rank: r,
            new_group=lambda ranks: tuple(ranks),
            group=SimpleNamespace(WORLD="world"),
        )
        monkeypatch.setattr(G, "dist", fake)
        G.destroy_expert_parallel_groups()
        G.init_tensor_parallel_groups(2)
        got = G.init_expert_parallel_groups(4, node_size=2)
        t, d = rank % 2, rank // 2
        position = list(range(t, world, 2))
        assert got.tensor.ranks == [rank - t, rank - t + 1] and got.dp_ranks == position
        assert got.ep_ranks == position[d // 4 * 4 : d // 4 * 4 + 4] and got.edp_ranks == position[d % 4 :: 4]
        assert got.intra_node_group == tuple(position[d // 2 * 2 : d // 2 * 2 + 2])
        assert got.inter_node_group == tuple(got.ep_ranks[d % 2 :: 2])
        assert got.edp_tp_group == tuple(sorted(position[d % 4 :: 4] + [r + 1 - 2 * t for r in position[d % 4 :: 4]]))
        dims = ParallelDims(world, tp=2, ep=4)
        assert dims.position(rank) == RankPosition(stage=0, tp_rank=t, dp_rank=d, ep_rank=d % 4) and dims.dp == 8
    G.destroy_expert_parallel_groups()
