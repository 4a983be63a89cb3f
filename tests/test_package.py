"""The installed package: import names, registration, remote-code loading without ds_optimus."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import ds_optimus
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM, MulaModel

ROOT = Path(__file__).resolve().parents[1]

# Makes `import ds_optimus` fail inside a subprocess, as on a machine where it is not installed.
HIDE_DS_OPTIMUS = textwrap.dedent(
    """
    import importlib.abc, sys
    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ds_optimus" or name.startswith("ds_optimus."):
                raise ImportError("ds_optimus is hidden in this test")
    sys.meta_path.insert(0, _Hide())
    """
)


def _run(code: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_import_registers_mula_with_the_auto_classes():
    values = MulaConfig.from_preset("mula-tiny-moe").to_dict()
    values.pop("model_type")
    config = AutoConfig.for_model("mula", **values)
    assert isinstance(config, MulaConfig)
    assert type(AutoModel.from_config(config)) is MulaModel
    assert type(AutoModelForCausalLM.from_config(config)) is MulaForCausalLM
    assert ds_optimus.__version__


def test_import_needs_neither_deepspeed_nor_triton():
    """With both made unimportable, the package, its ops and the models import, and the MoE layer
    runs (on its PyTorch backends). PyTorch itself imports Triton when it is installed, so what
    ds_optimus imports is checked by taking them away."""
    result = _run(
        "import sys\n"
        "sys.modules.update(deepspeed=None, triton=None)  # import fails, find_spec says absent\n"
        "import torch, ds_optimus, ds_optimus.ops, ds_optimus.hf_models.mula\n"
        "from ds_optimus.moe import MoELayer, select_backend\n"
        "out, _ = MoELayer(16, 8, 4, 2)(torch.randn(5, 16))\n"
        "print(sorted(m for m in ('deepspeed', 'triton') if sys.modules[m]), ds_optimus.ops.triton_available(),"
        " select_backend('cpu', torch.float32), tuple(out.shape))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[] False grouped_mm (5, 16)"


def test_sharded_optimizer_runs_without_deepspeed():
    """With DeepSpeed unimportable, `ds_optimus.optim.sharded` imports and the optimizer, driven on its
    own on a 1-process gloo group, trains an expert-parallel MoE layer exactly as torch AdamW does; it
    refuses expert parameters whose layout it was not given."""
    result = _run(
        "import sys\n"
        "sys.modules['deepspeed'] = None  # import fails, find_spec says absent\n"
        "import copy, torch, torch.distributed as dist\n"
        "from ds_optimus.optim.sharded import ShardedOptimizer, ShardedOptimizerError\n"
        "from ds_optimus.moe import MoELayer\n"
        "from ds_optimus.parallel import apply_expert_parallel, moe_param_groups\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "torch.manual_seed(0)\n"
        "layer = MoELayer(16, 8, 4, 2)\n"
        "reference = copy.deepcopy(layer)\n"
        "start = [p.detach().clone() for p in layer.parameters()]\n"
        "groups = apply_expert_parallel(layer, 1)\n"
        "names = {p: n for n, p in layer.named_parameters()}\n"
        "try:\n"
        "    ShardedOptimizer(torch.optim.AdamW(moe_param_groups(layer), lr=0.01), param_names=names, stage=2)\n"
        "except ShardedOptimizerError as err:\n"
        "    print(err)\n"
        "opt = ShardedOptimizer(torch.optim.AdamW(moe_param_groups(layer), lr=0.01), param_names=names, stage=2,\n"
        "                       expert_groups=[groups], bucket_size=100)\n"
        "ref = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)  # as moe_param_groups\n"
        "x = torch.randn(12, 16)\n"
        "for _ in range(3):\n"
        "    opt.backward(layer(x)[0].square().mean()); opt.step(); opt.zero_grad()\n"
        "    reference(x)[0].square().mean().backward(); ref.step(); ref.zero_grad()\n"
        "diff = max((a - b).abs().max().item() for a, b in zip(layer.parameters(), reference.parameters()))\n"
        "moved = min((a - b).abs().max().item() for a, b in zip(layer.parameters(), start))\n"
        "print(sys.modules['deepspeed'], type(opt).__module__, opt.state_dict()['step'], diff, moved)\n"
        "dist.destroy_process_group()\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    refusal, last = result.stdout.strip().splitlines()[-2:]
    assert refusal == (
        "expert parameters of layout 'ep_size_1' but no such layout in expert_groups; "
        "pass the groups apply_expert_parallel returned"
    )
    deepspeed, module, step, diff, moved = last.split()
    assert (deepspeed, module, step) == ("None", "ds_optimus.optim.sharded", "3")
    assert float(diff) <= 1e-6 and float(moved) > 1e-3  # every parameter trained, as AdamW trains it


@pytest.mark.parametrize(
    "imports",
    [
        "import ds_optimus, deepspeed",
        "import deepspeed, ds_optimus",
        # transformers and accelerate probe for DeepSpeed before importing it
        "import ds_optimus, importlib.util; importlib.util.find_spec('deepspeed'); import deepspeed",
        "import ds_optimus.optim.bucket_layout; from ds_optimus.optim.sharded import LossScaler",
    ],
)
def test_deepspeed_engine_is_hooked_whatever_the_import_order(imports):
    result = _run(
        "import warnings; warnings.simplefilter('error', UserWarning)\n"
        f"{imports}\n"
        "from deepspeed.runtime.engine import DeepSpeedEngine as E\n"
        "print(E._configure_zero_optimizer.__module__, E.save_checkpoint.__module__)"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    hooked = "ds_optimus.integrations.deepspeed_engine"
    assert result.stdout.strip().splitlines()[-1] == f"{hooked} {hooked}"


def test_saved_folder_loads_with_remote_code_where_ds_optimus_is_missing(tmp_path):
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", router_bias_update_rate=0.001)).eval()
    folder = tmp_path / "mula"
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_mula.MulaConfig",
        "AutoModel": "modeling_mula.MulaModel",
        "AutoModelForCausalLM": "modeling_mula.MulaForCausalLM",
    }
    x = torch.randint(2, 4096, (2, 9))
    torch.save({"x": x, "logits": model(x).logits}, tmp_path / "expected.pt")
    code = HIDE_DS_OPTIMUS + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        try:
            import ds_optimus
            raise SystemExit("ds_optimus was importable")
        except ImportError:
            pass
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        diff = (model(expected["x"]).logits - expected["logits"]).abs().max().item()
        gen = model.generate(expected["x"][:1], max_new_tokens=4, do_sample=False)
        base = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert type(base).__name__ == "MulaModel", type(base)
        print(type(model).__module__, type(model).__name__, diff, gen.shape[1], "ds_optimus" in sys.modules)
        """
    )
    result = _run(code, {"HF_MODULES_CACHE": str(tmp_path / "modules")}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    module, name, diff, length, imported = result.stdout.strip().splitlines()[-1].split()
    assert module.startswith("transformers_modules") and name == "MulaForCausalLM"
    assert float(diff) <= 1e-5 and int(length) == 13 and imported == "False"


@pytest.mark.slow
def test_non_editable_install_provides_all_import_names(tmp_path, installed_copy):
    target = installed_copy  # a clean copy installed with --target (tests/installed_copy.py)
    code = HIDE_DS_OPTIMUS.replace("sys.meta_path.insert(0, _Hide())", "") + textwrap.dedent(
        f"""
        sys.path = [p for p in sys.path if "__editable__" not in p]
        sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
        sys.path.insert(0, {str(target)!r})
        import ds_optimus, ds_optimus.ops, ds_optimus.hf_models.mula.convert_olmoe
        from ds_optimus.hf_models.mula import MulaConfig
        print(ds_optimus.__file__, ds_optimus.ops.__file__, MulaConfig.from_preset("mula-tiny-dense").model_type)
        """
    )
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    pkg, ops, model_type = result.stdout.strip().splitlines()[-1].split()
    assert pkg.startswith(str(target)) and ops.startswith(str(target)) and model_type == "mula"
    assert (target / "ds_optimus" / "hf_models" / "mula" / "modeling_mula.py").is_file()
