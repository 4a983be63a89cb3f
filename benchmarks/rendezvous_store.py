"""What torch.distributed's TCP store (the env:// rendezvous, served by rank 0) costs per request on
this machine, to scale to a world's rendezvous: `python benchmarks/rendezvous_store.py [--clients 16]
[--ops 2000]`. Each client process connects (as a rank does), then makes `--ops` requests of the
kinds a process-group start makes (add to a counter, set a key, get another's key). Prints the
server's requests a second with the libuv back-end (torch's default) and the older one, and writes
benchmarks/results/rendezvous_store.json."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from pathlib import Path


def _client(port: int, index: int, ops: int, use_libuv: bool, ready, go, out) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120), use_libuv=use_libuv)
    ready.put(index)
    go.wait()
    start = time.perf_counter()
    for i in range(ops // 3):
        store.add("counter", 1)
        store.set(f"key/{index}/{i}", b"x" * 128)  # an address or a communicator id: ~100 bytes
        store.get(f"key/{index}/{i}")
    out.put(time.perf_counter() - start)


def measure(clients: int, ops: int, use_libuv: bool) -> float:
    """Requests a second the server answered, all clients at once."""
    from torch.distributed import TCPStore

    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120), use_libuv=use_libuv
    )
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(server.port, i, ops, use_libuv, ready, go, out)) for i in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    start = time.perf_counter()
    go.set()
    for _ in procs:
        out.get()
    elapsed = time.perf_counter() - start
    for p in procs:
        p.join()
    return clients * (ops // 3) * 3 / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/rendezvous_store.py")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rates = {"libuv": [], "classic": []}
    for _ in range(args.repeats):  # interleaved
        for name in rates:
            rates[name].append(measure(args.clients, args.ops, name == "libuv"))
    result = {name: statistics.median(values) for name, values in rates.items()}
    # a start at 12,288 ranks: each rank connects and joins the world (a few requests), and each
    # process group it belongs to passes its communicator id through the store (one set, the
    # members' gets): about 10 requests a rank for ~6 kinds of groups
    requests = 12288 * 10
    result.update(
        clients=args.clients,
        ops=args.ops,
        requests_at_12288=requests,
        seconds_at_12288_libuv=requests / result["libuv"],
        seconds_at_12288_classic=requests / result["classic"],
    )
    print(
        f"TCP store, {args.clients} clients: libuv {result['libuv']:,.0f} requests/s, classic "
        f"{result['classic']:,.0f} requests/s (ratio {result['libuv'] / result['classic']:.2f}); "
        f"~{requests:,} requests at 12,288 ranks: {result['seconds_at_12288_libuv']:.1f} s (libuv)"
    )
    out = Path(__file__).resolve().parent / "results" / f"rendezvous_store_{args.clients}_clients.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
