"""The KV connector: everything about moving KV between workers.

- `params`: the typed `kv_transfer_params` of the wire (vLLM NixlConnector's names plus kvturn's), parsed and
  emitted in one place; the router uses it too.
- `policy`: every pull / recompute / decline decision, pure.
- `connector`: what the engine calls (admit, poll, finish, abort): remote loads, epoch checks, fallbacks,
  abandoned reads, retention.
- `leases`: blocks kept alive for a peer to read.
- `nixl_agent`: NIXL memory registration and block reads.
- `side_channel`: the peer-to-peer HTTP endpoints (agent metadata, lease acquire/release) and their client.

This package imports the engine; the engine imports nothing from it.
"""
