# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
# Ported to ds_optimus from deepspeedai/DeepSpeed, tests/conftest.py, commit
# edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (2026-08-22), under the Apache License 2.0: the three hooks
# that run DeepSpeed's DistributedTest classes in their own processes, as upstream's. Added: the
# subset that runs here (SUBSET) and this folder on sys.path for the `unit.` imports.
"""DeepSpeed's own unit tests of the areas ds_optimus patches (engine initialisation with client and
config optimizers, ZeRO-1/2 steps with gradient clipping, checkpoints of ZeRO optimizers), run with
ds_optimus imported in every rank (unit/common.py imports it). A patch that changes DeepSpeed's
behaviour for a config without an `optimus` section fails here.

SUBSET lists the test classes that run: those of the ported files that pass on a CPU with the
installed DeepSpeed without ds_optimus. Left out: `TestOptimizerImplementation` (its AMP cases
meet "NVIDIA Apex AMP integration has been removed" in the installed release), the learning-rate
scheduler classes (no patched method on their path), `TestZeROElasticCheckpoint` and
`TestZeROPPLoadCheckpoint` (their distributed fixtures are not found by this pytest), and the
accelerator-only classes (they skip on a CPU).

They run in a pytest process of their own (tests/test_deepspeed_upstream_subset.py starts it): some
run DeepSpeed's engine in pytest's own process, which leaves RANK, WORLD_SIZE, MASTER_* and a process
group behind there, as DeepSpeed's own runs of them do.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SUBSET = {
    "unit/runtime/test_ds_initialize.py": ("TestNoOptim", "TestClientOptimizer", "TestConfigOptimizer"),
    "unit/runtime/zero/test_zero_grad_clip.py": ("TestZeroGradClip",),
    "unit/v1/half_precision/test_gradient_clipping_default.py": (
        "TestGradientClippingConfig",
        "TestGradientClippingEndToEnd",
    ),
    "unit/checkpoint/test_zero_optimizer.py": ("TestZeRONonDistributed", "TestSaveTensorClone"),
}


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    kept, left = [], []
    for item in items:
        path = os.path.relpath(str(item.path), here)
        if not path.startswith("unit" + os.sep):
            kept.append(item)
        elif item.cls is not None and item.cls.__name__ in SUBSET.get(path, ()):
            kept.append(item)
        else:
            left.append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


# Override of pytest "runtest" for DistributedTest class
# This hook is run before the default pytest_runtest_call
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # We want to use our own launching function for distributed tests
    if getattr(item.cls, "is_dist_test", False):
        dist_test_class = item.cls()
        dist_test_class(item._request)
        item.runtest = lambda: True  # Dummy function so test is not run twice


# We allow DistributedTest to reuse distributed environments. When the last
# test for a class is run, we want to make sure those distributed environments
# are destroyed.
def pytest_runtest_teardown(item, nextitem):
    if getattr(item.cls, "reuse_dist_env", False) and not nextitem:
        dist_test_class = item.cls()
        for num_procs, pool in dist_test_class._pool_cache.items():
            dist_test_class._close_pool(pool, num_procs, force=True)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    if getattr(fixturedef.func, "is_dist_fixture", False):
        dist_fixture_class = fixturedef.func()
        dist_fixture_class(request)
