"""Reading and writing `kv_transfer_params` in vLLM NixlConnector's field names, plus kvturn's additions.

Pure functions: what a request asks for in, what a response carries out.
"""
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RemoteRef:
    """Where a peer retains blocks for this prompt, and the handle that names them."""
    engine_id: str | None
    host: str
    port: int
    handle: str
    binding_key: str  # what the lease is bound to: the conversation key, or P's request id for a P->D pin


@dataclass(frozen=True, slots=True)
class KVPlan:
    prefill_for_remote_decode: bool  # P role: compute the prompt, pin its blocks for D
    remote: RemoteRef | None  # blocks to read from a peer (D->P on P, P->D on D)


class BadKVParams(ValueError):
    pass


def plan(params: dict[str, Any] | None, conversation_key: str | None) -> KVPlan:
    if not params:
        return KVPlan(False, None)
    if not isinstance(params, dict):
        raise BadKVParams("kv_transfer_params must be an object")
    do_remote_decode = bool(params.get("do_remote_decode"))
    do_remote_prefill = bool(params.get("do_remote_prefill"))
    if do_remote_decode and do_remote_prefill:
        raise BadKVParams("do_remote_decode and do_remote_prefill cannot both be true")
    remote = None
    if params.get("handle") and params.get("remote_host") and params.get("remote_port"):
        port = params["remote_port"]
        if not isinstance(port, int) or not 0 < port < 65536:
            raise BadKVParams("remote_port must be an integer port")
        if do_remote_prefill:
            binding = params.get("remote_request_id")
        else:
            binding = conversation_key
        if binding:
            remote = RemoteRef(params.get("remote_engine_id"), str(params["remote_host"]), port,
                               str(params["handle"]), str(binding))
    elif do_remote_prefill:
        raise BadKVParams("do_remote_prefill needs remote_host, remote_port and handle")
    return KVPlan(do_remote_decode, remote)


def retention_params(retained: dict, engine_id: str, request_id: str, host: str, port: int,
                     for_decode: bool) -> dict[str, Any]:
    """What a worker returns for the blocks it retains: P's pin (for D to read) or D's lease (for next turn's P)."""
    return {
        "do_remote_prefill": for_decode,
        "do_remote_decode": not for_decode,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [retained["block_ids"]],
        "remote_block_hashes": retained["block_hashes"],
        "remote_block_epochs": retained["block_epochs"],
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": retained["num_tokens"],
        "remote_blocks_expiry_time": retained["expiry_time"],
        "handle": retained["handle"],
        "tp_size": 1,
        "transfer_mode": "pull",
    }
