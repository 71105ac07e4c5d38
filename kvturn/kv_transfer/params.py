"""`kv_transfer_params`, typed: vLLM NixlConnector's field names plus kvturn's, parsed and emitted here only.

Worker and router both use this module, so a field's name is written once. Parsing is strict about types
(a client or peer may send anything) and lenient about what it does not know (vLLM adds fields over time).
"""
import math
from dataclasses import dataclass, fields
from typing import Any

MAX_BLOCKS = 1 << 20  # a longer list is not a KV pool's worth of block ids
SECRET_HEADER = "X-Kvturn-Cluster-Secret"  # the cluster secret, shown by the router and by peers
POOL, HOST = "pool", "host"  # where a lease's blocks live on their holder: its engine pool, or its host tier
TIERS = (POOL, HOST)


class BadKVParams(ValueError):
    pass


def only_ints(values: list) -> bool:
    """Every item an int (not a bool, nor an int subclass): type() compared in C, as lists of thousands of block ids,
    hashes and epochs cross the wire every turn."""
    return set(map(type, values)) <= {int}


def _int_list(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        value = value[0]  # vLLM: one list per KV cache group; kvturn has one group
    if not isinstance(value, list) or len(value) > MAX_BLOCKS or not only_ints(value):
        raise BadKVParams(f"{name} must be a list of integers")
    return value


def _typed(value: Any, kind: type, name: str):
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadKVParams(f"{name} must be {kind.__name__}")
    if kind is float and not math.isfinite(value):
        raise BadKVParams(f"{name} must be finite")
    if kind is str and len(value) > 1024:
        raise BadKVParams(f"{name} is too long")
    return value


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    tp_size: int | None = None
    transfer_mode: str | None = None
    # kvturn's additions
    remote_block_hashes: list[int] | None = None  # chained hashes: P reuses only the prefix that really matches
    remote_block_epochs: list[int] | None = None  # read back after a transfer to catch recycled blocks
    handle: str | None = None  # names the retention lease; bound to the conversation
    first_token_id: int | None = None  # P's pin: the token P sampled after the prompt
    binding: str | None = None  # MAC of the handle and what the lease is bound to, under the cluster secret
    remote_blocks_tier: str | None = None  # where the blocks live on their holder: "pool" or "host" (its host tier)
    # Seconds the lease has left, as its last holder of the record counted them: each receiver sets its own deadline
    # on its own clock from this (remote_blocks_expiry_time is the holder's wall clock, which no other machine reads).
    remote_blocks_ttl_s: float | None = None
    # Tokens of this prompt P's own prefix cache held, relayed by the router to the decode worker, which weighs the
    # lease it will keep by it (retention.py: a history P's cache holds is little worth reading back)
    prefill_cached_tokens: int | None = None

    @classmethod
    def parse(cls, raw: Any) -> "KVTransferParams":
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise BadKVParams("kv_transfer_params must be an object")
        values = {}
        for spec in fields(cls):
            value = raw.get(spec.name)
            if spec.name in ("remote_block_ids", "remote_block_hashes", "remote_block_epochs"):
                values[spec.name] = _int_list(value, spec.name)
            elif spec.name in ("do_remote_prefill", "do_remote_decode"):
                values[spec.name] = bool(_typed(value, bool, spec.name))
            else:
                kind = {"remote_port": int, "remote_num_tokens": int, "tp_size": int, "first_token_id": int,
                        "remote_blocks_expiry_time": float, "remote_blocks_ttl_s": float,
                        "prefill_cached_tokens": int}.get(spec.name, str)
                values[spec.name] = _typed(value, kind, spec.name)
        params = cls(**values)
        if params.do_remote_decode and params.do_remote_prefill:
            raise BadKVParams("do_remote_decode and do_remote_prefill cannot both be true")
        if params.remote_port is not None and not 0 < params.remote_port < 65536:
            raise BadKVParams("remote_port must be a TCP port")
        if params.remote_blocks_tier not in (None, *TIERS):
            raise BadKVParams(f"remote_blocks_tier must be one of {TIERS}")
        if params.remote_blocks_ttl_s is not None and params.remote_blocks_ttl_s < 0:
            raise BadKVParams("remote_blocks_ttl_s must be >= 0")
        if params.prefill_cached_tokens is not None and params.prefill_cached_tokens < 0:
            raise BadKVParams("prefill_cached_tokens must be >= 0")
        return params

    def to_json(self) -> dict[str, Any]:
        out = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is None:
                continue
            out[spec.name] = [value] if spec.name == "remote_block_ids" else value
        return out

    @property
    def names_peer(self) -> bool:
        return bool(self.remote_host and self.remote_port)

    def lease_record(self) -> dict | None:
        """The peer's lease as it described it (the side channel's shape), when these params carry all of it."""
        if None in (self.handle, self.remote_block_ids, self.remote_block_hashes, self.remote_block_epochs,
                    self.remote_num_tokens, self.remote_blocks_expiry_time):
            return None
        return {"handle": self.handle, "tier": self.remote_blocks_tier or POOL, "block_ids": self.remote_block_ids,
                "block_hashes": self.remote_block_hashes, "block_epochs": self.remote_block_epochs,
                "num_tokens": self.remote_num_tokens, "expiry_time": self.remote_blocks_expiry_time,
                "ttl_s": self.remote_blocks_ttl_s, "first_token_id": self.first_token_id, "binding": self.binding}

    def for_next_prefill(self, remote_num_tokens: int | None = None) -> dict[str, Any]:
        """A decode worker's retention params, as the next turn's prefill call carries them (vLLM's proxy does
        the same): prefill for a remote decode, reading back what the decode worker retained."""
        out = self.to_json() | {"do_remote_decode": True, "do_remote_prefill": False}
        if remote_num_tokens is not None:
            out["remote_num_tokens"] = remote_num_tokens
        return out


PREFILL_STUB = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True, slots=True)
class RemoteRef:
    """Where a peer retains blocks for this prompt, and the handle that names them."""
    engine_id: str | None
    host: str
    port: int
    handle: str
    binding_key: str  # what the lease is bound to: the conversation key, or P's request id for a P->D pin
    record: dict | None = None  # the lease as the peer described it, relayed by the caller

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class KVPlan:
    prefill_for_remote_decode: bool  # P role: compute the prompt, pin its blocks for D
    remote: RemoteRef | None  # blocks to read from a peer (D->P on P, P->D on D)
    prefill_cached_tokens: int = 0  # of the prompt, what P's prefix cache held (on D, from the router)


def plan(raw: Any, conversation_key: str | None) -> KVPlan:
    """What a request's kv_transfer_params ask this worker to do."""
    params = KVTransferParams.parse(raw)
    remote = None
    if params.handle and params.names_peer:
        binding = params.remote_request_id if params.do_remote_prefill else conversation_key
        if binding:
            remote = RemoteRef(params.remote_engine_id, params.remote_host, params.remote_port, params.handle,
                               binding, params.lease_record())
    elif params.do_remote_prefill:
        raise BadKVParams("do_remote_prefill needs remote_host, remote_port and handle")
    return KVPlan(params.do_remote_decode, remote, params.prefill_cached_tokens or 0)


def retention_params(lease: dict, engine_id: str, request_id: str, host: str, port: int,
                     for_decode: bool, binding: str | None = None) -> dict[str, Any]:
    """What a worker returns for the blocks it retains: P's pin (for D to read) or D's lease (for next turn's P)."""
    return KVTransferParams(
        do_remote_prefill=for_decode, do_remote_decode=not for_decode, remote_engine_id=engine_id,
        remote_request_id=request_id, remote_block_ids=lease["block_ids"], remote_host=host, remote_port=port,
        remote_num_tokens=lease["num_tokens"], remote_blocks_expiry_time=lease["expiry_time"], tp_size=1,
        transfer_mode="pull", remote_block_hashes=lease["block_hashes"], remote_block_epochs=lease["block_epochs"],
        handle=lease["handle"], first_token_id=lease.get("first_token_id"), binding=binding,
        remote_blocks_tier=lease.get("tier"), remote_blocks_ttl_s=lease.get("ttl_s")).to_json()
