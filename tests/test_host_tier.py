"""The host tier of retained KV and the lease life cycle, between two real engines over a real NIXL loopback: a lease
moves whole to the host tier under pool pressure and is read there with identical output; a full host tier drops its
least recently used lease; reads that race a move, or fail, recompute; renewal and expiry on injected clocks."""
import time

import pytest

from kvturn.config import ConnectorConfig, EngineConfig
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.kv_transfer.connector import KVConnector, RemoteBlocks, RetainSpec
from kvturn.kv_transfer.side_channel import parse_lease
from kvturn.model.loader import load_model

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [3 + (i * 37) % 3000 for i in range(200)]
OTHER = [5 + (i * 53) % 3000 for i in range(150)]


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


class Node:
    def __init__(self, model, blocks: int = 64, prefix_caching: bool = True, clock=time.monotonic, **connector):
        self.engine = LLMEngine(model, EngineConfig(num_kv_blocks=blocks, enable_prefix_caching=prefix_caching),
                                emit=lambda out: None, detokenize=lambda ids: "", eos_token_ids=set())
        self.connector = KVConnector(self.engine, ConnectorConfig(kv_recompute_threshold_tokens=16, **connector),
                                     clock)

    def run(self, seq: Sequence) -> Sequence:
        self.engine.add_request(seq)
        deadline = time.monotonic() + 60
        while seq.request_id in self.engine.sequences and time.monotonic() < deadline:
            if not self.engine.step():
                time.sleep(0.001)
        assert seq.finish_reason is not None, "the request did not finish"
        return seq

    def retain(self, request_id: str, prompt: list[int], conversation: str) -> Sequence:
        return self.run(Sequence(request_id, prompt, PARAMS, retain=RetainSpec(60, conversation, False)))


def read_by(prefill: Node, decode: Node, handle: str, conversation: str) -> RemoteBlocks:
    """What P gets from D's side channel: D's current record of the lease (acquire), checked and on P's clock."""
    peer = prefill.connector.nixl.peers.get(decode.connector.engine_id) or \
        prefill.connector.nixl.add_peer(decode.connector.nixl.local_info())
    record = decode.connector.leases.acquire(handle, conversation)
    assert record is not None
    return parse_lease(record, peer, handle, 16, 4096, prefill.connector.clock())


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(model):
    return Node(model, prefix_caching=False).run(Sequence("ref", PROMPT, PARAMS)).output_token_ids


def host_node(model, **connector) -> Node:
    return Node(model, blocks=32, retained_host_mb=1, **connector)  # 16 host blocks


def test_pool_pressure_moves_a_lease_to_the_host_tier_and_the_next_turn_reads_it_there(model, reference):
    decode, prefill = host_node(model), Node(model, prefix_caching=False)
    turn = decode.retain("turn1", PROMPT[:150], "conv")
    pool_ids, pool_epochs = turn.retained["block_ids"], turn.retained["block_epochs"]
    decode.run(Sequence("big", OTHER * 3, SamplingParams(max_tokens=1)))  # needs nearly the whole pool
    leases = decode.connector.leases
    assert leases.moves[("pool", "host")] == 1 and leases.blocks_in("host") == len(pool_ids)
    assert all(decode.engine.block_manager.epochs[b] > e for b, e in zip(pool_ids, pool_epochs))
    remote = read_by(prefill, decode, turn.retained["handle"], "conv")
    assert remote.tier == "host"
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "reused" and seq.kv_tier == "host" and seq.num_remote_tokens == 9 * 16
    assert seq.output_token_ids == reference
    assert prefill.connector.stats.reads_by_tier["host"] == 1 and leases.reads["host"] == 1


def test_the_retained_budget_moves_the_least_recently_used_lease_and_a_full_host_tier_drops_its_oldest(model):
    decode = host_node(model, retained_kv_budget_mb=1)  # 16 pool blocks retained at most; 16 host blocks
    first = decode.retain("a", PROMPT[:150], "conv-a").retained  # 9 blocks
    second = decode.retain("b", OTHER[:130], "conv-b").retained  # 8 blocks: 17 > 16, "a" moves
    leases = decode.connector.leases
    assert leases.lookup(first["handle"], "conv-a").tier == "host"
    assert leases.lookup(second["handle"], "conv-b").tier == "pool"
    decode.retain("c", PROMPT[40:190], "conv-c")  # 9 more: "b" moves, the host tier is full, "a" is dropped
    assert leases.lookup(first["handle"], "conv-a") is None
    assert leases.lookup(second["handle"], "conv-b").tier == "host"
    assert leases.counts["reclaimed"] == 1 and leases.moves[("pool", "host")] == 2


def test_without_a_host_tier_pressure_drops_the_lease(model):
    decode = Node(model, retained_kv_budget_mb=1)
    first = decode.retain("a", PROMPT[:150], "conv-a").retained
    decode.retain("b", OTHER[:130], "conv-b")
    assert decode.connector.leases.lookup(first["handle"], "conv-a") is None
    assert decode.connector.leases.counts["reclaimed"] == 1


def test_a_read_racing_a_move_sees_the_epoch_change_and_recomputes(model, reference):
    decode, prefill = host_node(model), Node(model, prefix_caching=False)
    turn = decode.retain("turn1", PROMPT[:150], "conv")
    in_pool = read_by(prefill, decode, turn.retained["handle"], "conv")  # P has the pool record...
    assert decode.connector.leases.reclaim_oldest()  # ...and D moves the lease before P's read is checked
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=in_pool))
    # P's look at the epochs before reading sees it (lease_ended) when NIXL answers within its wait; else the read's
    # own epoch check does
    assert seq.reuse_outcome in ("lease_ended", "epoch_mismatch") and seq.num_remote_tokens == 0
    assert seq.output_token_ids == reference


def test_a_lease_a_peer_acquires_while_it_is_copied_stays_in_the_pool_and_the_next_one_moves(model, reference):
    decode, prefill = host_node(model), Node(model, prefix_caching=False)
    first = decode.retain("a", PROMPT[:150], "conv").retained
    second = decode.retain("b", OTHER[:130], "conv-b").retained
    host, acquired = decode.connector.host.cache, []
    copy = host.copy_blocks

    def copy_while_a_peer_acquires(*args):  # the side channel's thread answers P between the copy and the switch
        copy(*args)
        if not acquired:
            acquired.append(read_by(prefill, decode, first["handle"], "conv"))

    host.copy_blocks = copy_while_a_peer_acquires
    leases = decode.connector.leases
    assert leases.reclaim_oldest()
    assert leases.lookup(first["handle"], "conv").tier == "pool" and acquired[0].tier == "pool"
    assert leases.lookup(second["handle"], "conv-b").tier == "host" and leases.moves[("pool", "host")] == 1
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=acquired[0]))
    assert seq.reuse_outcome == "reused" and seq.output_token_ids == reference


def test_a_host_tier_read_of_a_dropped_lease_or_one_that_fails_recomputes(model, reference):
    decode, prefill = host_node(model), Node(model, prefix_caching=False)
    turn = decode.retain("turn1", PROMPT[:150], "conv")
    decode.connector.leases.reclaim_oldest()
    in_host = read_by(prefill, decode, turn.retained["handle"], "conv")
    decode.connector.leases.release(turn.retained["handle"], "conv")  # its host blocks are let go
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=in_host))
    assert seq.reuse_outcome in ("lease_ended", "epoch_mismatch") and seq.output_token_ids == reference
    in_host.block_ids = [b + 10_000 for b in in_host.block_ids]  # outside the host tier's registered memory
    seq = prefill.run(Sequence("again", PROMPT, PARAMS, remote=in_host))
    assert seq.reuse_outcome == "read_failed" and seq.output_token_ids == reference


def test_compute_on_decode_copies_the_history_back_from_the_host_tier(model, reference):
    decode = host_node(model)
    decode.retain("turn1", PROMPT[:150], "conv")
    decode.connector.leases.reclaim_oldest()
    decode.run(Sequence("big", OTHER * 3, SamplingParams(max_tokens=1)))  # the freed pool blocks are reused
    seq = decode.run(Sequence("turn2", PROMPT, PARAMS, retain=RetainSpec(60, "conv", False)))
    assert seq.kv_tier == "host" and seq.num_cached_tokens == 9 * 16
    assert seq.output_token_ids == reference
    assert decode.connector.stats.host_restores == 1 and decode.connector.leases.moves[("host", "pool")] == 1


def test_a_read_renews_the_lease_but_never_past_its_maximum_age():
    from kvturn.engine.block_manager import BlockManager
    from kvturn.kv_transfer.leases import LeaseTable
    clock, blocks = Clock(), BlockManager(32, 16)
    leases = LeaseTable(blocks, max_age_s=100.0, clock=clock)
    ids = [blocks.allocate_new() for _ in range(3)]
    lease = leases.retain(ids, [1, 2, 3], 48, "conv", ttl_s=30.0, release_after_read=False)
    clock.now += 25
    assert leases.acquire(lease.handle, "conv")["ttl_s"] == pytest.approx(30.0)
    clock.now += 25  # 50 s after it was made, past its first TTL
    assert leases.lookup(lease.handle, "conv") is lease and leases.counts["renewed"] == 1
    assert leases.acquire(lease.handle, "conv")["ttl_s"] == pytest.approx(30.0)
    clock.now += 29
    assert leases.acquire(lease.handle, "conv")["ttl_s"] == pytest.approx(21.0)  # capped at 100 s of age
    clock.now += 21
    assert leases.lookup(lease.handle, "conv") is None and leases.expire() == 1


def test_time_left_travels_as_a_duration_so_a_receiver_with_another_clock_honours_it(model, reference):
    decode = host_node(model, clock=Clock(50.0))
    prefill = Node(model, prefix_caching=False, clock=Clock(9_000_000.0))  # another machine: another origin
    turn = decode.retain("turn1", PROMPT[:150], "conv")
    record = dict(turn.retained)
    peer = prefill.connector.nixl.add_peer(decode.connector.nixl.local_info())
    remote = parse_lease(record, peer, record["handle"], 16, 4096, prefill.connector.clock())
    assert remote.deadline == pytest.approx(9_000_060.0)
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "reused" and seq.output_token_ids == reference
    # A wall-clock expiry far ahead does not keep alive a lease whose time left is below the margin.
    nearly_over = parse_lease({**record, "ttl_s": 2.0, "expiry_time": time.time() + 1e6}, peer, record["handle"], 16,
                              4096, prefill.connector.clock())
    seq = prefill.run(Sequence("late", PROMPT, PARAMS, remote=nearly_over))
    assert seq.reuse_outcome == "expired" and seq.output_token_ids == reference


def test_every_retention_leg_starts_decode_workers_whose_settings_are_accepted():
    from kvturn.bench.catalog import LEGS, RETENTION_LEGS
    from kvturn.cli import app
    from typer.main import get_command
    flags = {name for param in get_command(app).commands["worker"].params for name in param.opts}
    for leg in RETENTION_LEGS:
        args = LEGS[leg].decode_args
        assert set(args[::2]) <= flags, leg
        ConnectorConfig(**{flag.removeprefix("--").replace("-", "_"): int(value)
                           for flag, value in zip(args[::2], args[1::2])})


def test_the_router_sets_a_lease_deadline_from_its_time_left_never_from_the_holders_wall_clock():
    import asyncio

    from kvturn.router.conversations import Conversation, ConversationTable
    table = ConversationTable(ttl_s=450, max_entries=10)
    skewed = {"handle": "h", "remote_blocks_ttl_s": 30.0, "remote_blocks_expiry_time": time.time() - 3600}
    asyncio.run(table.put(Conversation("k", "http://d", skewed, 0.0, 1)))  # D's wall clock is an hour behind
    found, why = asyncio.run(table.lookup("k"))
    assert why is None and 29.0 < found.kv_params["remote_blocks_ttl_s"] <= 30.0  # handed on, counted down


def test_a_pull_from_the_host_tier_is_priced_by_that_tiers_own_read_speed():
    from kvturn.costmodel import PULL, RECOMPUTE, CostModel, TurnView, choose
    from kvturn.costmodel.fits import MIN_SAMPLES
    model = CostModel()
    read = {"prompt_tokens_computed": 100, "prompt_tokens_remote": 4096, "kv_read_bytes": 16 * 2**20}
    for _ in range(MIN_SAMPLES):
        model.observe_prefill("prefill", {**read, "timing": {"prefill_compute_ms": 20.0, "kv_read_ms": 4.0}})
        model.observe_prefill("prefill", {**read, "kv_tier": "host",
                                          "timing": {"prefill_compute_ms": 20.0, "kv_read_ms": 4000.0}})
    assert model.read_ms(4096) == pytest.approx(4.0) and model.read_ms(4096, tier="host") == pytest.approx(4000.0)
    turn = TurnView(4300, 4096, 0, False, 0)
    assert choose(model, turn, "adaptive", 0.5).path == PULL
    assert choose(model, TurnView(4300, 4096, 0, False, 0, retained_tier="host"), "adaptive", 0.5).path == RECOMPUTE


def test_the_router_guesses_a_lease_unused_past_its_workers_pool_horizon_is_in_the_host_tier():
    from types import SimpleNamespace

    from kvturn.router import lease_tier
    worker = SimpleNamespace(pool_horizon_s=None)
    entry = SimpleNamespace(stored_at=100.0)
    assert lease_tier.guess(entry, worker, now=500.0) == "pool"  # nothing has had to move there yet
    worker.pool_horizon_s = 60.0
    assert lease_tier.guess(entry, worker, now=150.0) == "pool"
    assert lease_tier.guess(entry, worker, now=161.0) == "host"


def test_the_host_tier_hands_out_a_run_of_consecutive_blocks_while_one_is_free():
    from kvturn.engine.kv_cache import LAYER_MAJOR, KVCache, KVLayout
    from kvturn.kv_transfer.host_tier import HostTier
    tier = HostTier(KVCache(KVLayout("qwen3", "float32", 4, 16, 2, 1, 4, LAYER_MAJOR)), 20)
    first, second, _ = tier.allocate(5), tier.allocate(5), tier.allocate(5)  # the third fills blocks 10-14
    tier.free(second)
    assert tier.allocate(3) == [5, 6, 7]  # the freed run, not whatever was freed first
    assert tier.allocate(4) == [15, 16, 17, 18]  # the gap of 2 left is too short
    tier.free(first)
    assert tier.allocate(7) == [0, 1, 2, 3, 4, 8, 9]  # no run is long enough: the lowest free ids
    assert tier.num_free_blocks == 1 and tier.allocate(2) is None
    assert list(tier.epochs[:5]) == [3] * 5  # handed out, let go, handed out: a stale reader sees the change
