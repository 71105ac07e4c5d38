"""Side-channel client: fetch a peer's NIXL metadata once, acquire and release its leases."""
import logging

import httpx

from kvturn.engine.sequence import RemoteBlocks
from kvturn.server.kv_params import RemoteRef
from kvturn.transfer import reuse_policy

log = logging.getLogger(__name__)
SECRET_HEADER = "X-Kvturn-Cluster-Secret"


class PeerClient:
    def __init__(self, cluster_secret: str | None, timeout_s: float):
        headers = {SECRET_HEADER: cluster_secret} if cluster_secret else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=timeout_s)
        self.known: dict[tuple[str, int], dict] = {}

    async def close(self) -> None:
        await self.http.aclose()

    async def agent_info(self, host: str, port: int, refresh: bool = False) -> dict:
        key = (host, port)
        if refresh or key not in self.known:
            response = await self.http.get(f"http://{host}:{port}/kv/agent")
            response.raise_for_status()
            self.known[key] = response.json()
        return self.known[key]

    async def acquire(self, ref: RemoteRef, engine_id: str) -> RemoteBlocks | str:
        """The peer's authoritative view of the lease, or a decline reason."""
        try:
            response = await self.http.post(f"http://{ref.host}:{ref.port}/kv/lease/acquire",
                                            json={"handle": ref.handle, "binding_key": ref.binding_key})
        except httpx.HTTPError:
            return reuse_policy.PEER_UNREACHABLE
        if response.status_code == 404:
            return reuse_policy.LEASE_UNKNOWN
        if response.status_code != 200:
            return reuse_policy.PEER_UNREACHABLE
        lease = response.json()
        return RemoteBlocks(engine_id, lease["block_ids"], lease["block_hashes"], lease["block_epochs"],
                            lease["expiry_time"], ref.handle, num_tokens=lease["num_tokens"],
                            first_token_id=lease.get("first_token_id"))

    async def release(self, ref: RemoteRef) -> None:
        try:
            await self.http.post(f"http://{ref.host}:{ref.port}/kv/lease/release",
                                 json={"handle": ref.handle, "binding_key": ref.binding_key})
        except httpx.HTTPError:
            log.info("could not release lease at %s:%s; it expires on its own", ref.host, ref.port)
