"""Hugging Face Transformers model classes of ds_optimus (installed as `ds_optimus.hf_models`)."""
