"""A short, self-contained Mula demo on CPU: build a preset, train it briefly on the embedded corpus,
save it, load it back through the Auto classes and generate.

    python -m ds_optimus.demo [--preset mula-tiny-moe] [--steps 60] [--out runs/demo]

The embedded corpus is the Python reference manual that every CPython ships (`pydoc_data.topics`),
read as UTF-8 bytes (token id = byte + 2; 0 is padding, 1 end of text), so nothing is downloaded.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in main(), after the arguments: --help needs no PyTorch
    import torch

BYTE_OFFSET = 2
TINY_PRESETS = ("mula-tiny-dense", "mula-tiny-moe")


def embedded_corpus() -> bytes:
    """The Python reference manual shipped with CPython, as UTF-8 bytes."""
    from .data.documents import embedded_documents

    return "\n\n".join(embedded_documents()).encode("utf-8")


def encode(data: bytes) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + BYTE_OFFSET


def decode(ids: torch.Tensor) -> str:
    return bytes(int(i) - BYTE_OFFSET for i in ids if int(i) >= BYTE_OFFSET).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    from .command_line import ArgumentParser

    parser = ArgumentParser("ds_optimus.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mula-tiny-moe", choices=TINY_PRESETS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs/demo", help="folder the trained model is saved to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 8:
        parser.error("--steps and --batch-size must be >= 1 and --seq-len >= 8")

    import torch
    from tqdm import tqdm

    import ds_optimus  # noqa: F401  (registers Mula with the Auto classes)
    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM, count_parameters

    torch.manual_seed(args.seed)
    config = MulaConfig.from_preset(args.preset)
    model = MulaForCausalLM(config)
    total, active = count_parameters(config)
    print(
        f"{args.preset}: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token, "
        f"experts implementation: {config._experts_implementation}"
    )

    data = encode(embedded_corpus())
    split = int(0.95 * len(data))
    train, held_out = data[:split], data[split:]
    print(f"embedded corpus: {len(data):,} bytes ({len(train):,} train, {len(held_out):,} held out)")

    def batch(source: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(source) - args.seq_len, (args.batch_size,), generator=generator)
        return torch.stack([source[s : s + args.seq_len] for s in starts.tolist()])

    def evaluate() -> float:
        model.eval()
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            losses = [model(x, labels=x).lm_loss.item() for x in (batch(held_out, gen) for _ in range(4))]
        model.train()
        return sum(losses) / len(losses)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.steps // 10)))
    gen = torch.Generator().manual_seed(args.seed)
    before = evaluate()
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for _ in bar:
        x = batch(train, gen)
        out = model(x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        postfix = {"lm": f"{out.lm_loss.item():.3f}"}
        if out.aux_loss is not None:
            postfix.update(balance=f"{out.aux_loss.item():.3f}", z=f"{out.z_loss.item():.2f}")
        bar.set_postfix(postfix)
    elapsed = time.perf_counter() - start
    after = evaluate()
    tokens = args.steps * args.batch_size * args.seq_len
    print(
        f"held-out loss {before:.3f} -> {after:.3f} after {args.steps} steps "
        f"({tokens / elapsed:,.0f} tokens/s on {torch.get_num_threads()} threads)"
    )

    out_dir = Path(args.out)
    model.save_pretrained(out_dir)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    prompt = encode(b'The "with" statement')[None]
    generated = loaded.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None)
    print(f"saved to {out_dir} and loaded back as {type(loaded).__name__} through AutoModelForCausalLM")
    print("greedy sample:", repr(decode(generated[0])))
    if not after < before:
        print("ds_optimus.demo: error: the held-out loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
