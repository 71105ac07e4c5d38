"""The side channel between workers: NIXL metadata and lease acquire/release over HTTP, behind the cluster secret.

`mount` adds the endpoints a worker serves to its peers; `PeerClient` calls them on a peer. The client sends
the cluster secret, so it only ever talks to a peer it trusts (`may_contact`), and it believes nothing a
peer answers until `parse_lease` has checked it: a peer's reply becomes a `RemoteBlocks` or a decline reason.
"""
import hashlib
import hmac
import json
import logging
import secrets
import time

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvturn.errors import error_response
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.connector import KVConnector, RemoteBlocks
from kvturn.kv_transfer.nixl_agent import Peer
from kvturn.kv_transfer.params import POOL, SECRET_HEADER, TIERS, RemoteRef, only_ints

log = logging.getLogger(__name__)
PEER_HEADER = "X-Kvturn-Peer"  # the caller's own side-channel address (host:port), so the peer can connect back


def has_secret(request: Request, secret: str | None) -> bool:
    """Whether the caller proved it belongs to the cluster (always true when the cluster has no secret)."""
    return secret is None or secrets.compare_digest(request.headers.get(SECRET_HEADER, ""), secret)


def refusal(request: Request, secret: str | None, on_refused) -> JSONResponse | None:
    """The 403 for a caller of a cluster-only endpoint that did not prove the secret (counted by `on_refused`), or
    None for one that did."""
    if has_secret(request, secret):
        return None
    on_refused()
    return error_response(403, "wrong or missing cluster secret")


PIN, LEASE = "pin", "lease"  # P's pin of a prompt for one decode; D's lease of a finished turn
# What the binding MACs. Not the lease's time left (`ttl_s`): whoever relays the record counts it down.
RECORD_FIELDS = ("handle", "block_ids", "block_hashes", "block_epochs", "num_tokens", "expiry_time", "first_token_id",
                 "tier")


def lease_binding(secret: str, kind: str, engine_id: str, address: str, binding_key: str, record: dict) -> str:
    """A MAC, under the cluster secret, of a lease's whole record as its holder made it, of the holder (its engine
    id and the side-channel address it advertises), of the kind of lease and of what it is bound to (a
    conversation, or P's request; a conversation key carries its tenant's scope): a peer handed the record by the
    router can trust every field of it, the address to contact included, without asking anyone, and only for that
    binding. A store that relays the record can neither alter it nor point it at another host."""
    fields = [kind, engine_id, address, binding_key, *(record.get(f) for f in RECORD_FIELDS)]
    try:
        message = orjson.dumps(fields)  # several times faster than json for ~550 hashes and ids, on P's turn
    except (TypeError, orjson.JSONEncodeError):  # what orjson cannot write (an int past 64 bits) binds nothing
        message = json.dumps(fields, separators=(",", ":"), default=repr).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def _ints(value, length: int | None = None, low: int = 0, high: int = 2**63) -> list[int] | None:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    if not only_ints(value) or (value and not (low <= min(value) and max(value) < high)):
        return None
    return value


def token_id(value, vocab_size: int) -> int | None:
    """`value` if it is a token id of this vocabulary (as a peer or a relayed record may name one), else None."""
    return value if type(value) is int and 0 <= value < vocab_size else None


def parse_lease(payload, peer: Peer, handle: str, block_size: int, vocab_size: int,
                now: float) -> RemoteBlocks | None:
    """A peer's account of its lease, checked field by field; None if anything is off. Its time left (`ttl_s`, a
    duration) becomes a deadline on the reader's own clock, of which `now` is the reading."""
    if not isinstance(payload, dict):
        return None
    tier = payload.get("tier", POOL)
    if tier not in TIERS:
        return None
    block_ids = _ints(payload.get("block_ids"), high=peer.blocks_in(tier))
    if not block_ids:
        return None
    hashes = _ints(payload.get("block_hashes"), len(block_ids))
    epochs = _ints(payload.get("block_epochs"), len(block_ids))
    ttl_s, num_tokens = payload.get("ttl_s"), payload.get("num_tokens")
    first_token = payload.get("first_token_id")
    expiry = payload.get("expiry_time")
    if ttl_s is None and type(expiry) in (int, float):
        ttl_s = max(expiry - time.time(), 0.0)  # a peer of a version before `ttl_s`: its wall clock, as it was
    if hashes is None or epochs is None or type(ttl_s) not in (int, float) or not 0 <= ttl_s < float("inf"):
        return None
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        return None
    if not (len(block_ids) - 1) * block_size < num_tokens <= len(block_ids) * block_size:
        return None
    if first_token is not None and token_id(first_token, vocab_size) is None:
        return None
    return RemoteBlocks(peer.engine_id, block_ids, hashes, epochs, now + ttl_s, handle, num_tokens=num_tokens,
                        first_token_id=first_token, tier=tier)


def peer_address(value: str | None) -> str | None:
    """`value` if it is a host:port a worker may be at, else None."""
    host, _, port = (value or "").rpartition(":")
    if not host or len(value) > 255 or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host or "@" in host:
        return None
    return value


class PeerClient:
    def __init__(self, cluster_secret: str | None, timeout_s: float, trusted_peers: list[str],
                 own_address: str | None = None):
        headers = {SECRET_HEADER: cluster_secret} if cluster_secret else {}
        if cluster_secret and own_address:
            headers[PEER_HEADER] = own_address
        self.secret = cluster_secret
        self.open_cluster = cluster_secret is None
        self.trusted = set(trusted_peers)
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout_s)
        self.known: dict[str, dict] = {}  # address -> the peer's agent info

    async def close(self) -> None:
        await self.http.aclose()

    def may_contact(self, ref: RemoteRef, caller_has_secret: bool, kind: str) -> str | None:
        """None if this worker may contact the peer `ref` names (and show it the cluster secret), else the decline
        reason. Trusted are a peer given at start-up, and, for a caller of the cluster, a peer named by a record
        that peer signed itself under the secret (the MAC covers its address): never an address only a client or
        the store that relayed the record named. In a cluster without a secret, any peer (as vLLM trusts its
        network; the worker warned at start-up)."""
        if self.open_cluster or ref.address in self.trusted:
            return None
        if not caller_has_secret:
            return policy.UNTRUSTED_PEER
        return None if self.record_is_bound(ref, kind) else policy.UNSIGNED_RECORD

    def binding(self, kind: str, engine_id: str, address: str, binding_key: str, record: dict) -> str | None:
        """What this worker's retention params carry in `binding` (nothing in a cluster without a secret)."""
        if self.secret is None:
            return None
        return lease_binding(self.secret, kind, engine_id, address, binding_key, record)

    def record_is_bound(self, ref: RemoteRef, kind: str) -> bool:
        """Whether the lease record a caller relayed is, field for field, what the peer at `ref.address` made under
        the cluster secret, for this kind of lease and this very binding."""
        relayed = (ref.record or {}).get("binding")
        if not isinstance(relayed, str) or ref.engine_id is None or ref.record is None:
            return False
        expected = self.binding(kind, ref.engine_id, ref.address, ref.binding_key, ref.record)
        return expected is not None and hmac.compare_digest(relayed, expected)

    def forget(self, engine_id: str) -> None:
        """Drop the agent info of whatever address `engine_id` was at: the next contact asks afresh."""
        for address, info in list(self.known.items()):
            if info.get("engine_id") == engine_id:
                del self.known[address]

    async def agent_info(self, address: str, refresh: bool = False) -> dict:
        if refresh or address not in self.known:
            response = await self.http.get(f"http://{address}/kv/agent")
            response.raise_for_status()
            info = response.json()
            if not isinstance(info, dict) or not isinstance(info.get("engine_id"), str):
                raise ValueError("the peer's agent info has no engine_id")
            self.known[address] = info
        return self.known[address]

    async def acquire(self, ref: RemoteRef, peer: Peer, block_size: int, vocab_size: int,
                      clock) -> RemoteBlocks | str:
        """The peer's authoritative view of the lease (which renews it there), or a decline reason. `clock`: the
        reader's own, on which the lease's deadline is set when the answer comes."""
        try:
            response = await self.http.post(f"http://{ref.address}/kv/lease/acquire",
                                            json={"handle": ref.handle, "binding_key": ref.binding_key})
        except httpx.HTTPError:
            return policy.PEER_UNREACHABLE
        if response.status_code == 404:
            return policy.LEASE_UNKNOWN
        if response.status_code != 200:
            return policy.PEER_UNREACHABLE
        try:
            payload = response.json()
        except ValueError:
            payload = None
        lease = parse_lease(payload, peer, ref.handle, block_size, vocab_size, clock())
        if lease is None:
            log.warning("peer %s answered a malformed lease; recomputing", ref.address)
            return policy.BAD_PEER_REPLY
        return lease

    async def release(self, ref: RemoteRef) -> None:
        try:
            await self.http.post(f"http://{ref.address}/kv/lease/release",
                                 json={"handle": ref.handle, "binding_key": ref.binding_key})
        except httpx.HTTPError:
            log.info("could not release lease at %s; it expires on its own", ref.address)


def mount(app: FastAPI, connector: KVConnector | None, secret: str | None, on_refused, run_on_engine,
          on_peer=None) -> None:
    """The endpoints a worker serves to its peers. `run_on_engine(fn)` awaits `fn` run on the engine thread;
    `on_peer(address)` hears of a peer of the cluster that fetched our agent info (so we can connect back)."""

    def refused(request: Request) -> JSONResponse | None:
        if connector is None:
            return error_response(404, "this worker does not transfer KV")
        return refusal(request, secret, on_refused)

    async def lease_request(request: Request) -> tuple[str, str] | JSONResponse:
        """(handle, binding_key) of an authorised lease call, or the error response."""
        if (denied := refused(request)) is not None:
            return denied
        try:
            data = await request.json()
            handle, key = data["handle"], data["binding_key"]
            if not isinstance(handle, str) or not isinstance(key, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return error_response(400, "expected {handle: str, binding_key: str}")
        return handle, key

    @app.get("/kv/agent")
    async def agent(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        caller = peer_address(request.headers.get(PEER_HEADER))
        if caller and secret is not None and on_peer is not None:  # only a caller that proved the secret
            on_peer(caller)
        return JSONResponse(connector.nixl.local_info())

    @app.post("/kv/lease/acquire")
    async def acquire(request: Request):
        parsed = await lease_request(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        record = connector.leases.acquire(*parsed)
        if record is None:
            return error_response(404, "no live lease with that handle for that key")
        return JSONResponse(record)

    @app.post("/kv/lease/release")
    async def release(request: Request):
        parsed = await lease_request(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        released = await run_on_engine(lambda: connector.leases.release(*parsed))
        return {"released": released}

    @app.post("/kv/conversation/release")
    async def release_conversation(request: Request):
        """A session ended (the router's DELETE /v1/conversations/{id}): drop what this worker retains for it."""
        if (denied := refused(request)) is not None:
            return denied
        try:
            key = (await request.json())["binding_key"]
            if not isinstance(key, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return error_response(400, "expected {binding_key: str}")
        released = await run_on_engine(lambda: connector.leases.release_conversation(key))
        return {"released": released}
