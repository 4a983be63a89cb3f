"""The end of a run: the Hugging Face folder of every expert, and a sample from it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def export(model, tokenizer, folder: Path, groups, record=None) -> None:
    """Write an HF folder for the Hub (collective): the model with every expert gathered, tokenizer, generation
    config, a Mula model's card."""
    from ..parallel.expert_parallel import export_pretrained
    from .model_card import model_card

    is_mula = getattr(model.config, "model_type", None) == "mula"
    if tokenizer is not None and getattr(model.config, "max_position_embeddings", None):
        tokenizer.model_max_length = model.config.max_position_embeddings  # not the "unlimited" 1e30
    card = model_card(model.config, record=record, tokenizer=tokenizer) if is_mula else None
    generation = generation_config(tokenizer) if tokenizer is not None else None
    tensor = groups.tensor if groups is not None else None
    if groups is None or (groups.pipeline is None and tensor is None):
        export_pretrained(model, folder, groups, tokenizer=tokenizer, model_card=card, generation_config=generation)
        return
    from ..parallel.expert_parallel import gather_experts
    from ..parallel.tensor_parallel import join_for_writer, split_parameters

    # each stage's first rank writes (rank 0 without stages); its EP group gathers the experts, its TP group
    # the split weights
    writer = groups.pipeline.stage_ranks[0] if groups.pipeline is not None else 0
    state = (
        model.state_dict()
        if groups.ep_size == 1 or writer not in groups.ep_ranks
        else gather_experts(model, groups, writer)
    )
    if tensor is not None:
        state = (
            join_for_writer(state, split_parameters(model), tensor.group, tensor.ranks.index(writer))
            if writer in tensor.ranks
            else None
        )
    if groups.pipeline is None:
        export_pretrained(
            model,
            folder,
            groups,
            tokenizer=tokenizer,
            model_card=card,
            generation_config=generation,
            state_dict=state if dist.get_rank() == writer else {},
        )
        return
    from ..parallel.pipeline import write_stage_weights

    export_pretrained(
        model, folder, groups, tokenizer=tokenizer, model_card=card, generation_config=generation, state_dict={}
    )
    write_stage_weights(folder, state, groups.pipeline)


def generation_config(tokenizer):
    """A `GenerationConfig` of `tokenizer`'s bos, eos and pad (else eos) ids."""
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)


def sample(folder: Path, prompt: str, new_tokens: int, seed: int = 0) -> str:
    """A continuation of `prompt` by the model in `folder` (top-k sampling, fixed seed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=True,  # a small model decoded greedily mostly repeats one token
            top_k=40,
            temperature=0.8,
            repetition_penalty=1.3,
            pad_token_id=tokenizer.pad_token_id,
        )
    torch.set_rng_state(generator_state)
    return tokenizer.decode(out[0], skip_special_tokens=True)
