"""Expert kernels of ds_optimus as PyTorch custom ops (installed as `ds_optimus.ops`).

Importable without DeepSpeed or Triton, so GPU machines that only carry PyTorch can load it.
"""
