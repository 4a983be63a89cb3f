"""Transformers' own common model tests, run against Mula.

The mixins come from the source distribution of the installed Transformers (tests/transformers_sdist.py
fetches it once into a cache outside the repository; without the package index this module skips,
and fails under CI).
Mula gets the ones a Transformers MoE language model such as OLMoE gets: the common model tests, the
config tests, the tensor- and expert-parallel tests (multi-process, so marked slow) and the training
(overfit) test. Left out: the pipeline mixin, which needs tiny checkpoints from the Hub and a file the
sdist does not ship. The sdist has no generation mixin either; the checks at the end of this module
cover what it would for Mula: static-cache and compiled generation, and custom 4D attention masks.
"""

from __future__ import annotations

import unittest
from functools import wraps
from unittest import mock

import pytest
import torch
import transformers_sdist
from needs import missing

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM, MulaModel

try:
    transformers_sdist.load()
except transformers_sdist.SdistUnavailable as err:
    missing(
        f"Transformers' model-test mixins unavailable (the source distribution comes from the package "
        f"index once): {err}"
    )


common = transformers_sdist.module("test_modeling_common")
config_common = transformers_sdist.module("test_configuration_common")


def _optional(name: str):
    """A mixin module that older Transformers releases (down to the oldest setup.py admits) do not ship
    yet: None there, and its tests are simply not part of the class."""
    try:
        return transformers_sdist.module(name)
    except ModuleNotFoundError:
        return None


generation_mixin = transformers_sdist.module("generation.test_utils")
tensor_parallel = _optional("test_tensor_parallel_mixin")
expert_parallel = _optional("test_expert_parallel_mixin")
training = _optional("test_training_mixin")

ids_tensor = common.ids_tensor


class MulaModelTester:
    """Builds a tiny Mula and its inputs for the mixins, in the shapes Transformers' own MoE testers
    use: hidden 32, GQA (4 heads, 2 KV heads), 2 layers, the first dense and the second MoE (8 experts
    of width 16, top-2), so that both kinds of feed-forward layer and both halves of the parallel plans
    are exercised."""

    config_class = MulaConfig
    base_model_class = MulaModel
    causal_lm_class = MulaForCausalLM

    batch_size = 13
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 37
    num_experts = 8
    num_experts_per_tok = 2
    moe_intermediate_size = 16
    moe_layer_freq = 2
    max_position_embeddings = 512
    # read by the mixins' helpers for other model kinds
    type_sequence_label_size = 2
    num_labels = 3
    num_choices = 4

    def __init__(self, parent: unittest.TestCase, **config_overrides) -> None:
        self.parent = parent
        self.config_overrides = config_overrides

    def get_config(self) -> MulaConfig:
        return MulaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            moe_layer_freq=self.moe_layer_freq,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **self.config_overrides,
        )

    def prepare_config_and_inputs_for_common(self) -> tuple[MulaConfig, dict]:
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # right padding, rows of every length
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}

    def create_and_check_model(self, config: MulaConfig, inputs: dict) -> None:
        model = self.base_model_class(config).eval()
        out = model(**inputs)
        self.parent.assertEqual(out.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))


class _CommonTests(
    common.ModelTesterMixin,
    generation_mixin.GenerationTesterMixin,
    *(
        mixin
        for mixin in (
            tensor_parallel and tensor_parallel.TensorParallelTesterMixin,
            expert_parallel and expert_parallel.ExpertParallelTesterMixin,
            training and training.TrainingTesterMixin,
        )
        if mixin
    ),
):
    """The mixins, set up for one model family (`model_tester_class`, `all_model_classes`)."""

    model_tester_class = None
    # Names Transformers' auto tables give its own models; a model registered through AutoModel.register
    # is missing there, and the mixins read them to tell base models from heads.
    auto_names: dict[str, str] = {}

    @classmethod
    def setUpClass(cls) -> None:
        from transformers.models.auto import modeling_auto

        cls._patches = [
            mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {cls.auto_names["model_type"]: cls.auto_names["base"]}),
            mock.patch.dict(
                modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                {cls.auto_names["model_type"]: cls.auto_names["causal_lm"]},
            ),
        ]
        for patch in cls._patches:
            patch.start()

    @classmethod
    def tearDownClass(cls) -> None:
        for patch in cls._patches:
            patch.stop()

    def setUp(self) -> None:
        self.model_tester = self.model_tester_class(self)
        self.config_tester = config_common.ConfigTester(
            self, config_class=self.model_tester.config_class, hidden_size=32
        )

    def test_config(self) -> None:
        self.config_tester.run_common_tests()

    def test_model(self) -> None:
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs_for_common())


# Older releases' parallel mixins spawn their ranks with functions pickled by module name, which a
# spawned process cannot import from the fetched sdist; newer ones go through `run_distributed`,
# which tests/transformers_sdist.py stands in for.
_SPAWNS_UNIMPORTABLE = tensor_parallel is not None and not hasattr(tensor_parallel, "run_distributed")


def _mark_slow_tests(cls: type) -> type:
    """Marks slow (they still run in CI) the distributed tensor/expert-parallel tests, which spawn
    processes, and the training mixin's 300-step overfit run (over a minute on two cores)."""
    for name in dir(cls):
        original = getattr(cls, name)
        distributed = name.startswith(("test_tp_", "test_ep_")) and name not in (
            "test_tp_plan_matches_params",
            "test_tp_plan_shards_input_embeddings",
        )
        if callable(original) and (distributed or name == "test_training_overfit"):

            @wraps(original)
            def run(self, _original=original, _distributed=distributed):
                if _distributed and _SPAWNS_UNIMPORTABLE:
                    self.skipTest(
                        "this Transformers release's parallel mixin spawns ranks that cannot import "
                        "the fetched tests (its newer releases use run_distributed)"
                    )
                return _original(self)

            setattr(cls, name, pytest.mark.slow(run))
    return cls


@_mark_slow_tests
class MulaCommonTest(_CommonTests, unittest.TestCase):
    model_tester_class = MulaModelTester
    all_model_classes = (MulaModel, MulaForCausalLM)
    auto_names = {"model_type": "mula", "base": "MulaModel", "causal_lm": "MulaForCausalLM"}

    _NO_CONVERSION = (
        "Mula saves the layout it holds (stacked experts) and has no older layout to convert, "
        "so that a saved folder also loads as remote code"
    )

    @unittest.skip(_NO_CONVERSION)
    def test_reverse_loading_mapping(self) -> None: ...

    @unittest.skip(_NO_CONVERSION)
    def test_can_load_from_already_mapped_keys(self) -> None: ...


class MulaRouterBiasFloat32Test(unittest.TestCase):
    """The mixin's float32 checks on the one tensor Mula keeps in float32, the router's selection bias,
    which exists when auxiliary-loss-free balancing is on (without it the list is empty and they skip)."""

    all_model_classes = (MulaModel, MulaForCausalLM)
    test_keep_in_fp32_modules_exist = common.ModelTesterMixin.test_keep_in_fp32_modules_exist
    test_keep_in_fp32_modules = common.ModelTesterMixin.test_keep_in_fp32_modules

    def setUp(self) -> None:
        self.model_tester = MulaModelTester(self, router_bias_update_rate=0.01)


# The distributed tests cover the model types Transformers lists; Mula joins them as OLMoE is listed.
if tensor_parallel is not None:
    tensor_parallel.TP_DISTRIBUTED_TEST_MODEL_TYPES = {*tensor_parallel.TP_DISTRIBUTED_TEST_MODEL_TYPES, "mula"}
if expert_parallel is not None:
    expert_parallel.EP_DISTRIBUTED_TEST_MODEL_TYPES = {*expert_parallel.EP_DISTRIBUTED_TEST_MODEL_TYPES, "mula"}


# -- generation: what the generation mixin (not in the sdist) checks -----------------------------------


def _tiny_lm(**overrides) -> MulaForCausalLM:
    torch.manual_seed(0)
    return MulaForCausalLM(MulaModelTester(None, **overrides).get_config()).eval()


def _left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(3, MulaModelTester.vocab_size, (2, 6))
    attention_mask = torch.ones_like(input_ids)
    input_ids[0, :2], attention_mask[0, :2] = 0, 0  # the first prompt is two tokens shorter
    return input_ids, attention_mask


def test_static_cache_generation_matches_the_dynamic_cache():
    model = _tiny_lm()
    input_ids, attention_mask = _left_padded_prompts()
    runs = [
        model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=8,
            do_sample=False,
            cache_implementation=cache,
            output_scores=True,
            return_dict_in_generate=True,
        )
        for cache in ("dynamic", "static")
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[0].scores), torch.stack(runs[1].scores))


@pytest.mark.parametrize(
    "experts",
    [
        "grouped_mm",
        "ds_optimus",
    ],
)
def test_generation_compiles_without_graph_breaks(experts):
    """Greedy generation through a forward compiled with `fullgraph=True` (a graph break fails) on a
    static cache gives the tokens of eager generation. Dynamo's capture is what is checked: the
    aot_eager backend traces forward and backward graphs as Inductor's would, without compiling kernels."""
    model = _tiny_lm()
    model.set_experts_implementation(experts)
    input_ids, attention_mask = _left_padded_prompts()
    expected = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False, cache_implementation="static"
    )
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    got = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False, cache_implementation="static"
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_sequences_match_separate_runs(attention):
    """Two sequences packed in one row, told apart by a custom 4D mask or (without a cache) by restarting
    positions alone, give the logits each gives on its own (attention stays inside a sequence; routing
    is per token)."""
    model = _tiny_lm()
    model.set_attn_implementation(attention)
    first, second = torch.randint(3, 99, (1, 5)), torch.randint(3, 99, (1, 4))
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0)
    same_sequence = torch.block_diag(torch.ones(5, 5), torch.ones(4, 4)).bool()
    allowed = same_sequence & torch.ones(9, 9).tril().bool()
    mask_4d = torch.zeros(1, 1, 9, 9).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = torch.cat([model(first).logits, model(second).logits], dim=1)
        by_mask = model(packed, attention_mask=mask_4d, position_ids=position_ids).logits
        by_positions = model(packed, position_ids=position_ids, use_cache=False).logits  # as in training
    torch.testing.assert_close(by_mask, expected)
    torch.testing.assert_close(by_positions, expected)
