"""A per-node health probe the supervisor runs, one rank a node, before it relaunches a run:

    mpiexec -n {nodes} --ppn 1 --hostfile {hostfile} python -m ds_optimus.reliability.probe

Each rank checks its accelerators, a matmul and a collective, and writes
`<DS_OPTIMUS_PROBE_DIR>/<host>.json`; a hung node writes nothing, and the missing file names it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def check_node(devices: int) -> str | None:
    """None when this node's devices and a matmul on one are sound, else what failed."""
    import torch

    accelerator = (
        "cuda" if torch.cuda.is_available() else "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu"
    )
    count = {"cuda": torch.cuda.device_count, "xpu": lambda: torch.xpu.device_count(), "cpu": lambda: 0}[accelerator]()
    if count < devices:
        return f"{count} {accelerator} device{'s' if count != 1 else ''} visible, {devices} expected"
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=generator, dtype=torch.float64)
    b = torch.randn(256, 256, generator=generator, dtype=torch.float64)
    expected = a @ b
    device = f"{accelerator}:0" if accelerator != "cpu" else "cpu"
    got = (a.to(device, torch.float32) @ b.to(device, torch.float32)).double().cpu()
    # float32 inputs: each of the 256 products rounds at 2^-24 relative, so the sums stay within
    # 256 x 2^-24 x |a||b| summed; 1e-3 of the largest entry's scale is far outside that and far
    # inside what a broken device gives (garbage, NaN)
    scale = (a.abs() @ b.abs()).max().item()
    if not torch.isfinite(got).all() or (got - expected).abs().max().item() > 1e-3 * scale:
        return f"a matmul on {device} differs from the CPU's"
    return None


def check_collective() -> str | None:
    """None when an all-reduce and a ring exchange (gloo) carry the right numbers, else what failed."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    if total.item() != world * (world + 1) / 2:
        return f"an all-reduce gave {total.item():g}, not {world * (world + 1) / 2:g}"
    if world > 1:
        out, got = torch.tensor([float(rank)]), torch.zeros(1)
        send = dist.isend(out, (rank + 1) % world)
        dist.recv(got, (rank - 1) % world)
        send.wait()
        if got.item() != (rank - 1) % world:
            return f"rank {rank} received {got.item():g} from its neighbour, not {(rank - 1) % world}"
    return None


def _injected(host: str) -> str | None:
    """A failure the tests planned for this host in `DS_OPTIMUS_FAULTS`."""
    faults = json.loads(os.environ.get("DS_OPTIMUS_FAULTS") or "[]")
    return "fault injected" if any(f.get("kind") == "probe" and f.get("host") == host for f in faults) else None


def main(argv: list[str] | None = None) -> int:
    from ..command_line import ArgumentParser, fail
    from ..launch.environment import LaunchError, adopt, this_host

    parser = ArgumentParser(
        "ds_optimus.reliability.probe",
        launched=True,
        description="Check this node (devices, a matmul, a collective with its neighbours).",
    )
    parser.add_argument("--devices", type=int, default=0, help="accelerators each node must show (default 0)")
    args = parser.parse_args(argv)
    folder = Path(os.environ.get("DS_OPTIMUS_PROBE_DIR", "probe"))
    host = this_host()
    try:
        world = adopt()
    except LaunchError as err:
        return fail(parser.name, err, launched=True)
    try:
        reason = check_node(args.devices) or _injected(host)
    except Exception as err:  # noqa: BLE001  (any failure of the node is the probe's finding)
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    collective = None
    if world.size > 1:  # every rank joins, whatever its own check found: a missing rank fails the others
        try:
            import datetime

            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
            collective = check_collective()
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001
            collective = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    # a node is failed by its own check, or by writing nothing (hung, dead); a collective that fails
    # everywhere for want of one rank names no node, so it is recorded, not held against this one
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{host}.json").write_text(
        json.dumps({"host": host, "ok": reason is None, "reason": reason, "collective": collective})
    )
    print(
        f"probe {host}: {'ok' if reason is None else reason}" + (f" (collective: {collective})" if collective else ""),
        file=sys.stderr,
        flush=True,
    )
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(main())
