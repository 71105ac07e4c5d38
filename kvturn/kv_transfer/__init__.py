"""The KV connector: everything about moving KV between workers.

- `params`: the typed `kv_transfer_params` of the wire (vLLM NixlConnector's names plus kvturn's), parsed and
  emitted in one place; the router uses it too.
- `policy`: every pull / recompute / decline decision, pure.
- `connector`: what the engine calls (admit, poll, finish, abort): remote loads, epoch checks, fallbacks,
  abandoned reads, retention.
- `leases`: blocks kept alive for a peer to read: their life (renewal, release, expiry) and their moves between tiers.
- `host_tier`: the second, larger region of retained blocks outside the engine pool (docs/retention.md).
- `nixl_agent`: NIXL memory registration (pool, host tier, epochs) and block reads from either tier of a peer.
- `side_channel`: the peer-to-peer HTTP endpoints (agent metadata, lease acquire/release, a conversation's release)
  and their client.

This package imports the engine; the engine imports nothing from it.
"""
