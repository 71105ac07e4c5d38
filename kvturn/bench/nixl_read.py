"""Measure NIXL READ time between two processes: raw (one descriptor) and as kvturn block reads.

Used by `benchmarks/transfer.py`, by the benchmark report's ideal-speedup estimate and, as a probe timing raw reads
while a benchmark's load runs, by `benchmarks/memory_pressure.py`.
`python -m kvturn.bench.nixl_read --serve MIB MODEL_DIR` is the remote side;
`python -m kvturn.bench.nixl_read --probe NBYTES INTERVAL_S MODEL_DIR` the probe.
"""
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvturn.engine.kv_cache import KVCache, KVLayout
from kvturn.model.config import ModelConfig
from kvturn.kv_transfer.nixl_agent import DONE, IN_PROGRESS, KVTransferAgent


def make_side(model_dir: str | Path, pool_mib: int, name: str, block_size: int = 16):
    """A KV pool of the model's layout plus a raw buffer of the same size, both registered with NIXL."""
    cfg = ModelConfig.from_dir(model_dir)
    block_bytes = KVLayout.for_model(cfg, 1, block_size).block_bytes
    kv = KVCache(KVLayout.for_model(cfg, max(pool_mib * 2**20 // block_bytes, 1), block_size))
    kv.pool.normal_()
    agent = KVTransferAgent(kv, np.zeros(kv.layout.num_blocks, dtype=np.int64), engine_id=name)
    raw = torch.empty(pool_mib * 2**20, dtype=torch.uint8)
    raw.random_(0, 255)
    agent.register(raw.data_ptr(), raw.numel())
    agent.metadata = agent.agent.get_agent_metadata()  # now it describes the raw buffer too
    return agent, kv, raw


def wait(agent: KVTransferAgent, handle) -> None:
    while (state := agent.poll(handle)) == IN_PROGRESS:
        pass
    agent.release(handle)
    if state != DONE:
        raise RuntimeError(f"transfer ended in state {state}")


def median_seconds(fns: list, repeats: int) -> list[float]:
    """Median time of each function, run in rotation so that machine noise hits all alike."""
    for fn in fns:
        fn()  # warm-up: first-use costs (UCX endpoints, registration caches)
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, samples):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


class ReadBench:
    """This process reads from a second process's pool and raw buffer."""

    def __init__(self, model_dir: str | Path, pool_mib: int, remote_netns: str | None = None, env: dict | None = None):
        """`remote_netns`: the network namespace the remote side runs in (bench/netns.py), `env` its extra
        environment (UCX's transports)."""
        from kvturn.launch import enter_netns
        self.remote = subprocess.Popen([sys.executable, "-m", "kvturn.bench.nixl_read", "--serve", str(pool_mib),
                                        str(model_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, **(env or {})},
                                       preexec_fn=(lambda: enter_netns(remote_netns)) if remote_netns else None)
        line = ""
        while not line.startswith("HELLO "):  # NIXL logs to stdout too
            line = self.remote.stdout.readline()
            if not line:
                raise RuntimeError("the remote side exited before it was ready")
        hello = json.loads(line[6:])
        self.raw_address = hello["raw_address"]
        self.agent, self.kv, self.raw = make_side(model_dir, pool_mib, "bench-local")
        self.peer = self.agent.add_peer(hello["info"])
        self.block_bytes = self.kv.layout.block_bytes

    def raw_read(self, nbytes: int):
        """A function doing one raw READ of `nbytes` as a single descriptor."""
        def read():
            local = self.agent.agent.get_xfer_descs([(self.raw.data_ptr(), nbytes, 0)], "DRAM")
            remote = self.agent.agent.get_xfer_descs([(self.raw_address, nbytes, 0)], "DRAM")
            handle = self.agent.agent.initialize_xfer("READ", local, remote, self.peer.agent_name)
            self.agent.agent.transfer(handle)
            wait(self.agent, handle)
        return read

    def block_read(self, block_ids: list[int]):
        """A function reading `block_ids` of the remote pool into the same ids of ours, as the engine does."""
        return lambda: wait(self.agent, self.agent.start_block_read(self.peer.engine_id, block_ids, block_ids))

    def raw_read_s(self, nbytes: int, repeats: int = 5) -> float:
        return median_seconds([self.raw_read(nbytes)], repeats)[0]

    def close(self) -> None:
        self.remote.stdin.close()
        self.remote.wait(timeout=30)

    def __enter__(self) -> "ReadBench":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RawReadProbe:
    """Raw NIXL READs of `nbytes`, one every `interval_s`, timed by a process pair of their own while something else
    runs: the bandwidth a reader gets from this machine in the same moments (on a shared machine it changes from
    minute to minute, and a benchmark's own load takes its share)."""

    def __init__(self, model_dir: str | Path, nbytes: int, interval_s: float = 0.2):
        self.nbytes = nbytes
        self.process = subprocess.Popen([sys.executable, "-m", "kvturn.bench.nixl_read", "--probe", str(nbytes),
                                         str(interval_s), str(model_dir)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[float]:
        """End the probe; the seconds each of its reads took."""
        out, _ = self.process.communicate(timeout=60)  # closing its stdin ends it
        for line in out.splitlines():
            if line.startswith("SAMPLES "):
                return json.loads(line[8:])
        raise RuntimeError(f"the raw-read probe exited ({self.process.returncode}) without its samples")

    def __enter__(self) -> "RawReadProbe":
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _probe(nbytes: int, interval_s: float, model_dir: str) -> None:
    with ReadBench(model_dir, nbytes // 2**20 + 2) as bench:
        read = bench.raw_read(nbytes)
        read()  # first-use costs
        samples = []
        while not select.select([sys.stdin], [], [], interval_s)[0]:  # stdin turns readable when it closes
            start = time.perf_counter()
            read()
            samples.append(time.perf_counter() - start)
    print("SAMPLES " + json.dumps(samples), flush=True)


def _serve(pool_mib: int, model_dir: str) -> None:
    agent, kv, raw = make_side(model_dir, pool_mib, "bench-remote")
    print("HELLO " + json.dumps({"info": agent.local_info(), "raw_address": raw.data_ptr()}), flush=True)
    sys.stdin.read()  # hold the memory until the reader is done


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        _serve(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "--probe":
        _probe(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
    else:
        sys.exit("usage: python -m kvturn.bench.nixl_read --serve MIB MODEL_DIR | --probe NBYTES INTERVAL_S MODEL_DIR")
