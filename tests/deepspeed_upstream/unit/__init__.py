# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
# Ported to ds_optimus from deepspeedai/DeepSpeed, tests/unit/__init__.py, commit
# edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (2026-08-22), under the Apache License 2.0. Unchanged.
'''Copyright The Microsoft DeepSpeed Team'''
