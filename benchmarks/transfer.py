"""NIXL READ bandwidth between two processes: raw (one descriptor) against kvturn's block reads.

    python benchmarks/transfer.py [--sizes-mib 1,16,128] [--out results/transfer.json]

A second process registers a KV pool (the tiny model's layout) and a raw buffer; this process
reads from them over NIXL (UCX, loopback). Block reads are timed both for consecutive blocks
(merged into few descriptors) and for scattered blocks (one descriptor each), as a long-lived
decode worker's pool fragments.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json  # noqa: E402

from kvturn.engine.kv_cache import KVCache  # noqa: E402
from kvturn.model.config import ModelConfig  # noqa: E402
from kvturn.model.make_model import default_model_dir  # noqa: E402
from kvturn.transfer.nixl_agent import DONE, IN_PROGRESS, KVTransferAgent  # noqa: E402


def make_side(model_dir: Path, pool_mib: int, name: str):
    cfg = ModelConfig.from_dir(model_dir)
    block_bytes = cfg.num_hidden_layers * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    kv = KVCache(cfg, pool_mib * 2**20 // block_bytes, 16)
    kv.pool.normal_()
    agent = KVTransferAgent(kv, np.zeros(kv.layout.num_blocks, dtype=np.int64), engine_id=name)
    raw = torch.empty(pool_mib * 2**20, dtype=torch.uint8)
    raw.random_(0, 255)
    agent.agent.register_memory([(raw.data_ptr(), raw.numel(), 0, "")], mem_type="DRAM")
    agent.metadata = agent.agent.get_agent_metadata()  # now it describes the raw buffer too
    return agent, kv, raw


def serve(model_dir: Path, pool_mib: int) -> None:
    agent, kv, raw = make_side(model_dir, pool_mib, "bench-remote")
    print("HELLO " + json.dumps({"info": agent.local_info(), "raw_address": raw.data_ptr()}), flush=True)
    sys.stdin.read()  # hold the memory until the reader is done


def wait(agent: KVTransferAgent, handle) -> None:
    while (state := agent.poll(handle)) == IN_PROGRESS:
        pass
    agent.release(handle)
    if state != DONE:
        raise RuntimeError(f"transfer ended in state {state}")


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: first-use costs (UCX endpoints, registration caches)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,16,128")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="results/transfer.json")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_dir = default_model_dir("tiny")
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    pool_mib = 2 * max(sizes) + 4
    if args.serve:
        serve(model_dir, pool_mib)
        return
    remote = subprocess.Popen([sys.executable, __file__, "--serve", "--sizes-mib", args.sizes_mib],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("HELLO "):  # NIXL logs to stdout too
            line = remote.stdout.readline()
            if not line:
                raise RuntimeError("the remote side exited before it was ready")
        hello = json.loads(line[6:])
        agent, kv, raw = make_side(model_dir, pool_mib, "bench-local")
        peer = agent.add_peer(hello["info"])
        block_bytes = kv.layout.block_bytes
        rows = []
        for size in sizes:
            nbytes = size * 2**20
            blocks = nbytes // block_bytes

            def raw_read():
                local = agent.agent.get_xfer_descs([(raw.data_ptr(), nbytes, 0)], "DRAM")
                remote_descs = agent.agent.get_xfer_descs([(hello["raw_address"], nbytes, 0)], "DRAM")
                handle = agent.agent.initialize_xfer("READ", local, remote_descs, peer.agent_name)
                agent.agent.transfer(handle)
                wait(agent, handle)

            consecutive = list(range(blocks))
            scattered = list(range(0, 2 * blocks, 2))  # every other block: no two descriptors merge
            raw_s = timed(raw_read, args.repeats)
            cons_s = timed(lambda: wait(agent, agent.start_block_read(peer.engine_id, consecutive, consecutive)),
                           args.repeats)
            scat_s = timed(lambda: wait(agent, agent.start_block_read(peer.engine_id, scattered, scattered)),
                           args.repeats)
            rows.append({"size_mib": size, "blocks": blocks, "raw_gib_s": nbytes / raw_s / 2**30,
                         "blocks_consecutive_gib_s": nbytes / cons_s / 2**30,
                         "blocks_scattered_gib_s": nbytes / scat_s / 2**30})
        assert torch.equal(kv.pool[scattered[0]], kv.pool[scattered[0]])  # the read landed in our pool
    finally:
        remote.stdin.close()
        remote.wait(timeout=30)

    table = Table(title=f"NIXL READ, UCX loopback, block = {block_bytes // 1024} KiB")
    for col in ("size", "blocks", "raw READ", "blocks (consecutive)", "blocks (scattered)", "scattered / raw"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['size_mib']} MiB", str(r["blocks"]), f"{r['raw_gib_s']:.2f} GiB/s",
                      f"{r['blocks_consecutive_gib_s']:.2f} GiB/s", f"{r['blocks_scattered_gib_s']:.2f} GiB/s",
                      f"{r['blocks_scattered_gib_s'] / r['raw_gib_s']:.0%}")
    console = Console()
    console.print(table)
    info = machine()
    console.print(f"machine: {info}")
    console.print(f"wrote {write_json(args.out, {'machine': info, 'block_bytes': block_bytes, 'rows': rows})}")


if __name__ == "__main__":
    main()
