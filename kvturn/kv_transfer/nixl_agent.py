"""Moves KV blocks between workers with NIXL READs (UCX backend, DRAM).

Each worker registers its KV pool and its block-epoch array once, a decode worker with a host
tier its host blocks and their epochs too, and a worker whose prefix cache has a host tier (engine/prefix_host.py)
that region and its slot epochs: every registration is here. A peer is added from the
metadata its side channel returns; reads then go straight from the peer's memory (pool or host
tier) into our pool, one descriptor per run of blocks consecutive on both sides, per layer and key/value
(the pool is layer-major, engine/kv_cache.py). Called from the engine thread only.
"""
import base64
import logging
import uuid
from dataclasses import dataclass, replace

import numpy as np

from kvturn.engine.kv_cache import KVCache, KVLayout
from kvturn.engine.prefix_host import PrefixHostTier
from kvturn.kv_transfer.host_tier import HOST, HostTier

BEFORE_LAYOUT_ORDER = "block-major"  # the pool of a peer whose layout does not name its order

log = logging.getLogger(__name__)

DONE, IN_PROGRESS, FAILED = "DONE", "PROC", "ERR"
# NIXL's Python wrapper starts the UCX progress thread with a 0 us delay: it busy-spins a whole core,
# which on a small machine halves the compute left for prefill. With a delay it waits on UCX's event
# fd between polls (an idle worker then uses ~2% of a core) and reads run at the same speed.
PROGRESS_THREAD_DELAY_US = 1000


def create_nixl_agent(name: str):
    """A NIXL agent (UCX backend) whose progress thread sleeps between events instead of spinning."""
    from nixl_cu12 import _api

    base = _api.nixlBind.nixlAgentConfig

    class SleepingProgressConfig(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value):
            base.pthrDelay.__set__(self, PROGRESS_THREAD_DELAY_US)

    _api.nixlBind.nixlAgentConfig = SleepingProgressConfig
    try:
        return _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    finally:
        _api.nixlBind.nixlAgentConfig = base


class LayoutMismatch(ValueError):
    pass


@dataclass(slots=True)
class Peer:
    engine_id: str
    agent_name: str
    pool_address: int
    epochs_address: int
    layout: KVLayout
    host_address: int = 0  # the peer's host tier of retained blocks, when it has one
    host_epochs_address: int = 0
    host_blocks: int = 0

    def blocks_in(self, tier: str) -> int:
        return self.host_blocks if tier == HOST else self.layout.num_blocks

    def layout_of(self, tier: str) -> KVLayout:
        """The layout of a tier of the peer: the pool's, with the tier's own number of blocks."""
        return replace(self.layout, num_blocks=self.blocks_in(tier))

    def addresses(self, tier: str) -> tuple[int, int]:
        """(blocks, epochs) base addresses of a tier of the peer."""
        return (self.host_address, self.host_epochs_address) if tier == HOST else (self.pool_address,
                                                                                  self.epochs_address)


def _runs(local_ids: list[int], remote_ids: list[int]):
    """Group (local, remote) block pairs into runs that are consecutive on both sides."""
    runs: list[list[int]] = []  # [local_start, remote_start, count]
    for local, remote in zip(local_ids, remote_ids):
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == remote:
            runs[-1][2] += 1
        else:
            runs.append([local, remote, 1])
    return runs


class KVTransferAgent:
    def __init__(self, kv_cache: KVCache, epochs: np.ndarray, engine_id: str | None = None,
                 host: HostTier | None = None, prefix_host: PrefixHostTier | None = None):
        self.engine_id = engine_id or f"kvturn-{uuid.uuid4().hex[:12]}"
        self.kv_cache = kv_cache
        self.layout = kv_cache.layout
        self.epochs = epochs
        self.host = host
        self.prefix_host = prefix_host
        # Remote epochs land at the local block's index; a look before a read (probe) in the second half, so that a
        # look still in flight can never write over the read-back that vouches for the bytes read.
        self.epoch_scratch = np.zeros(2 * len(epochs), dtype=np.int64)
        self.agent = create_nixl_agent(self.engine_id)
        regions = [(kv_cache.base_address, kv_cache.nbytes), (epochs.ctypes.data, epochs.nbytes),
                   (self.epoch_scratch.ctypes.data, self.epoch_scratch.nbytes)]
        if host is not None:
            regions += [(host.cache.base_address, host.cache.nbytes), (host.epochs.ctypes.data, host.epochs.nbytes)]
        if prefix_host is not None:
            regions += [(prefix_host.cache.base_address, prefix_host.cache.nbytes),
                        (prefix_host.epochs.ctypes.data, prefix_host.epochs.nbytes)]
        self._registrations = [self.register(address, nbytes) for address, nbytes in regions]
        self.metadata = self.agent.get_agent_metadata()
        self.peers: dict[str, Peer] = {}

    def register(self, address: int, nbytes: int):
        """Register host memory with NIXL, so that peers can read it (after the metadata is fetched again)."""
        return self.agent.register_memory([(address, nbytes, 0, "")], mem_type="DRAM")

    def local_info(self) -> dict:
        """What a peer needs to read from us; served by the side channel."""
        info = {
            "engine_id": self.engine_id,
            "agent_metadata": base64.b64encode(self.metadata).decode(),
            "pool_address": self.kv_cache.base_address,
            "epochs_address": int(self.epochs.ctypes.data),
            "layout": {f: getattr(self.layout, f) for f in self.layout.__slots__},
        }
        if self.host is not None:
            host = self.host
            info["host"] = {"address": host.cache.base_address, "epochs_address": int(host.epochs.ctypes.data),
                            "num_blocks": host.num_blocks}
        if self.prefix_host is not None:
            region = self.prefix_host
            info["prefix_host"] = {"address": region.cache.base_address,
                                   "epochs_address": int(region.epochs.ctypes.data), "num_blocks": region.num_slots}
        return info

    def add_peer(self, info: dict) -> Peer:
        """Connect to a peer from its side-channel metadata; raises ValueError on anything malformed."""
        try:
            engine_id = info["engine_id"]
            layout = KVLayout(**{"order": BEFORE_LAYOUT_ORDER, **info["layout"]})
            pool_address, epochs_address = int(info["pool_address"]), int(info["epochs_address"])
            metadata = base64.b64decode(info["agent_metadata"], validate=True)
            if not isinstance(engine_id, str) or not isinstance(layout.num_blocks, int) or layout.num_blocks <= 0:
                raise TypeError("engine_id or num_blocks")
            host = info.get("host") or {}
            host_blocks = host.get("num_blocks", 0) if isinstance(host, dict) else None
            if type(host_blocks) is not int or host_blocks < 0:
                raise TypeError("host num_blocks")
            host_address, host_epochs = (int(host["address"]), int(host["epochs_address"])) if host_blocks else (0, 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed peer agent info: {exc!r}") from None
        if engine_id in self.peers:
            return self.peers[engine_id]
        differing = self.layout.compatible_with(layout)
        if differing:
            raise LayoutMismatch(f"peer {engine_id} has a different KV layout ({', '.join(differing)}): "
                                 f"ours {self.layout}, theirs {layout}")
        agent_name = self.agent.add_remote_agent(metadata)
        name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
        peer = Peer(engine_id, name, pool_address, epochs_address, layout, host_address, host_epochs, host_blocks)
        self.peers[engine_id] = peer
        return peer

    def forget_peer(self, engine_id: str) -> None:
        peer = self.peers.pop(engine_id, None)
        if peer is not None:
            try:
                self.agent.remove_remote_agent(peer.agent_name)
            except Exception:  # the peer may already be gone; nothing to undo then
                log.debug("remove_remote_agent(%s) failed", peer.agent_name, exc_info=True)

    def start_block_read(self, engine_id: str, remote_ids: list[int], local_ids: list[int], tier: str = "pool"):
        """Read blocks `remote_ids` of the peer's `tier` (its pool, or its host tier) into our pool's `local_ids`."""
        peer = self.peers[engine_id]
        pieces = self._pieces(peer, remote_ids, local_ids, tier)
        return self._start(peer, [d for local, _ in pieces for d in local], [d for _, remote in pieces for d in remote])

    def layer_reads(self, engine_id: str, remote_ids: list[int], local_ids: list[int], tier: str = "pool"):
        """The same read as start_block_read, in one transfer per layer: returns what posts layer l's (and returns
        its handle), so that a step can compute layer l as soon as layer l has arrived."""
        peer = self.peers[engine_id]
        pieces = self._pieces(peer, remote_ids, local_ids, tier)
        return lambda layer: self._start(peer, *pieces[layer])

    def _pieces(self, peer: Peer, remote_ids: list[int], local_ids: list[int], tier: str) -> list[tuple[list, list]]:
        """(local, remote) NIXL descriptors of a read, per layer: each layer's keys and values of each run of blocks
        consecutive on both sides (the pool is layer-major: piece i of a run is layer i // 2)."""
        blocks_address, _ = peer.addresses(tier)
        layers = [([], []) for _ in range(self.layout.num_layers)]
        for local_start, remote_start, count in _runs(local_ids, remote_ids):
            local = self.kv_cache.run_regions(local_start, count)
            remote = peer.layout_of(tier).run_regions(blocks_address, remote_start, count)
            for i, ((l_addr, l_len), (r_addr, r_len)) in enumerate(zip(local, remote)):
                layers[i // 2][0].append((l_addr, l_len, 0))
                layers[i // 2][1].append((r_addr, r_len, 0))
        return layers

    def start_epoch_read(self, engine_id: str, remote_ids: list[int], local_ids: list[int], tier: str = "pool",
                         probe: bool = False):
        """Read the peer's current epochs of `remote_ids` (of `tier`) into epoch_scratch[local_ids] (its probe half
        with `probe`)."""
        peer = self.peers[engine_id]
        _, epochs_address = peer.addresses(tier)
        item = self.epochs.itemsize
        base = self.epoch_scratch.ctypes.data + (len(self.epochs) * item if probe else 0)
        local, remote = [], []
        for local_start, remote_start, count in _runs(local_ids, remote_ids):
            local.append((base + local_start * item, count * item, 0))
            remote.append((epochs_address + remote_start * item, count * item, 0))
        return self._start(peer, local, remote)

    def _start(self, peer: Peer, local: list, remote: list):
        local_descs = self.agent.get_xfer_descs(local, "DRAM")
        remote_descs = self.agent.get_xfer_descs(remote, "DRAM")
        handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, peer.agent_name)
        state = self.agent.transfer(handle)
        if state == FAILED:
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL READ from {peer.engine_id} failed to start")
        return handle

    def poll(self, handle) -> str:
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception:  # UCX reports a dead peer by raising
            log.warning("NIXL transfer failed", exc_info=True)
            state = FAILED
        return state

    def release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            log.debug("release_xfer_handle failed", exc_info=True)

    def scratch_epochs(self, local_ids: list[int], probe: bool = False) -> list[int]:
        return self.epoch_scratch[np.asarray(local_ids, dtype=np.int64) + (len(self.epochs) if probe else 0)].tolist()
