"""The prefix cache's host tier: blocks the pool evicts are kept in a host region and copied back on a later prefix
hit with output equal to a recompute, and a decode worker reads them from P over NIXL; the region drops its least
recently used block first; a slot recycled or holding another hash is not restored; a worker started with
--prefix-host-mb serves a turn from it, counted."""
import time

import httpx
import pytest
import torch

from kvturn import launch
from kvturn.config import ConfigError, ConnectorConfig, EngineConfig
from kvturn.engine.block_manager import block_hashes
from kvturn.engine.kv_cache import KVCache, KVLayout
from kvturn.engine.llm import LLM
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.prefix_host import EPOCH_MISMATCH, HASH_MISMATCH, HostHit, PrefixHostTier
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.kv_transfer.connector import KVConnector, RetainSpec
from kvturn.kv_transfer.side_channel import parse_lease
from kvturn.model.loader import load_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HISTORY = [3 + (i * 37) % 3000 for i in range(100)]
OTHER = [5 + (i * 53) % 3000 for i in range(230)]  # with its answer, 15 of the pool's 16 blocks


def region(slots: int, pool_blocks: int = 4) -> PrefixHostTier:
    pool = KVCache(KVLayout("qwen3", "float32", pool_blocks, 4, 2, 1, 8, "layer-major"))
    pool.pool.copy_(torch.randn(pool.pool.shape))
    return PrefixHostTier(pool, slots)


def tokens_of(block: int) -> tuple[int, ...]:
    return tuple(range(block * 4, block * 4 + 4))


def test_an_evicted_block_comes_back_byte_for_byte():
    tier = region(slots=2)
    original = tier.pool.block(1)
    tier.keep(1, 111, tokens_of(0))
    hits = tier.lookup(list(tokens_of(0)), [111], 0, 4)
    tier.pool.pool[:, :, 1] = 0  # the pool gives the block new contents
    assert tier.restore(hits, [3]) == 1
    assert torch.equal(tier.pool.block(3), original)
    assert tier.stats.blocks_stored == 1 and tier.stats.blocks_restored == 1


def test_the_region_lets_go_of_its_least_recently_used_block_first():
    tier = region(slots=2)
    tier.keep(0, 100, tokens_of(0))
    tier.keep(1, 101, tokens_of(1))
    assert tier.lookup(list(tokens_of(0)), [100], 0, 4)  # a hit makes 100 the most recently used
    tier.keep(2, 102, tokens_of(2))
    assert set(tier.hash_to_slot) == {100, 102} and tier.stats.blocks_dropped == 1


def test_a_hit_needs_the_tokens_as_well_as_the_hash():
    tier = region(slots=2)
    tier.keep(0, 100, tokens_of(0))
    assert tier.lookup(list(tokens_of(1)), [100], 0, 4) == []


def test_a_slot_recycled_after_its_lookup_is_not_restored():
    tier = region(slots=1)
    tier.keep(0, 100, tokens_of(0))
    hits = tier.lookup(list(tokens_of(0)), [100], 0, 4)
    tier.keep(1, 101, tokens_of(1))  # the prompt's own new blocks evict another block into the only slot
    assert tier.restore(hits, [2]) == 0
    assert tier.stats.restore_failures[EPOCH_MISMATCH] == 1


def test_a_slot_holding_another_hash_than_the_position_expects_is_not_restored():
    tier = region(slots=2)
    tier.keep(0, 100, tokens_of(0))
    found = tier.lookup(list(tokens_of(0)), [100], 0, 4)[0]
    assert tier.restore([HostHit(found.slot, found.epoch, 999)], [2]) == 0
    assert tier.stats.restore_failures[HASH_MISMATCH] == 1


def test_the_host_tier_needs_prefix_caching_on():
    with pytest.raises(ConfigError):
        EngineConfig(prefix_host_mb=1, enable_prefix_caching=False)


def test_a_history_evicted_to_the_host_tier_and_restored_gives_the_recomputed_tokens(tiny_model_dir):
    reference = LLM(tiny_model_dir, EngineConfig(num_kv_blocks=16, enable_prefix_caching=False))
    expected = reference.generate([HISTORY], GREEDY)[0]
    llm = LLM(tiny_model_dir, EngineConfig(num_kv_blocks=16, prefix_host_mb=1))  # 16 host blocks of the tiny model
    assert llm.generate([HISTORY], GREEDY)[0] == expected
    llm.generate([OTHER], GREEDY)  # takes the pool: the history's blocks move to the host tier
    host = llm.engine.prefix_host
    assert host.stats.blocks_stored >= 5
    cached_before, host_before = llm.engine.stats.prompt_tokens_cached, llm.engine.stats.prompt_tokens_cached_host
    assert llm.generate([HISTORY], GREEDY)[0] == expected
    from_host = llm.engine.stats.prompt_tokens_cached_host - host_before
    assert from_host >= 5 * 16 and host.stats.blocks_restored == from_host // 16
    assert llm.engine.stats.prompt_tokens_cached - cached_before == 6 * 16  # every reusable block: pool + host


def test_without_the_host_tier_the_evicted_history_is_computed(tiny_model_dir):
    llm = LLM(tiny_model_dir, EngineConfig(num_kv_blocks=16))
    llm.generate([HISTORY], GREEDY)
    llm.generate([OTHER], GREEDY)
    cached_before = llm.engine.stats.prompt_tokens_cached
    llm.generate([HISTORY], GREEDY)
    assert llm.engine.prefix_host is None and llm.engine.stats.prompt_tokens_cached - cached_before < 2 * 16


def test_tenants_salts_keep_their_host_blocks_apart():
    tier = region(slots=2)
    tokens = list(tokens_of(0))
    tier.keep(0, block_hashes(tokens, 4, seed=1)[0], tuple(tokens))
    assert tier.lookup(tokens, block_hashes(tokens, 4, seed=2), 0, 4) == []


def test_a_decode_worker_reads_the_blocks_p_restored_from_its_host_tier_over_nixl(tiny_model_dir):
    """P's prompt blocks copied back from its host tier are real KV: D reads them (P->D) and answers as a recompute."""
    model = load_model(tiny_model_dir)

    def node(**settings):
        engine = LLMEngine(model, EngineConfig(**settings), emit=lambda out: None, detokenize=lambda ids: "",
                           eos_token_ids=set())
        return engine, KVConnector(engine, ConnectorConfig(kv_recompute_threshold_tokens=16))

    def run(engine, seq):
        engine.add_request(seq)
        deadline = time.monotonic() + 60
        while seq.request_id in engine.sequences and time.monotonic() < deadline:
            if not engine.step():
                time.sleep(0.001)
        assert seq.finish_reason is not None
        return seq

    prefill, prefill_kv = node(num_kv_blocks=16, prefix_host_mb=1)
    decode, decode_kv = node(num_kv_blocks=64)
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run(prefill, Sequence("turn1", HISTORY, first_token))
    run(prefill, Sequence("other", OTHER, first_token))  # the history moves to P's host tier
    prompt = HISTORY + [7, 8, 9]
    pinned = run(prefill, Sequence("turn2", prompt, first_token, retain=RetainSpec(30, "conv", True)))
    assert pinned.num_host_cached_tokens >= 5 * 16
    peer = decode_kv.nixl.add_peer(prefill_kv.nixl.local_info())
    handle = pinned.retained["handle"]
    remote = parse_lease(prefill_kv.leases.acquire(handle, "conv"), peer, handle, 16, 4096, decode_kv.clock())
    remote.prefilled_for_us = True
    seq = run(decode, Sequence("decode", prompt, GREEDY, remote=remote))
    assert seq.reuse_outcome == "reused" and seq.num_remote_tokens >= 6 * 16
    expected = LLM(tiny_model_dir, EngineConfig(num_kv_blocks=16, enable_prefix_caching=False))
    assert seq.output_token_ids == expected.generate([prompt], GREEDY)[0]


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    port = launch.free_port()
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    process = launch.start(["worker", "--port", str(port), "--model", str(tiny_model_dir), "--num-kv-blocks", "24",
                            "--prefix-host-mb", "2", "--max-model-len", "384", "--served-model-name", "tiny",
                            "--no-calibrate"], log)
    url = f"http://127.0.0.1:{port}"
    launch.wait_healthy(url, process)
    yield url
    launch.stop(process)


def complete(url: str, prompt: list[int]) -> dict:
    reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_worker_serves_a_second_turn_from_its_prefix_host_tier(worker):
    first = complete(worker, HISTORY)
    complete(worker, OTHER + OTHER[:140])  # the whole pool: every block of the first turn's history is evicted
    second = complete(worker, HISTORY + [7, 8, 9])
    assert second["kvturn"]["prompt_tokens_cached_host"] == 6 * 16
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 16
    assert first["choices"][0]["text"] and second["kvturn"]["prompt_tokens_computed"] == len(HISTORY) + 3 - 6 * 16
    metrics = httpx.get(f"{worker}/metrics").text
    assert 'kvturn_prefix_cache_hit_tokens_total{tier="host"}' in metrics


def test_the_report_says_where_each_later_turns_prompt_came_from():
    from kvturn.bench.client import RequestRecord, RunResult
    from kvturn.bench.prefix_sources import leg_sources
    result = RunResult()
    result.requests += [
        RequestRecord("c", 0, 0, 1, 0.0, warmup=False, input_num_tokens=500),  # a first turn: not counted
        RequestRecord("c", 0, 1, 3, 0.0, warmup=False, input_num_tokens=1000, prompt_tokens_cached_prefill=600,
                      prompt_tokens_cached_prefill_host=400),
        RequestRecord("c", 0, 2, 5, 0.0, warmup=False, input_num_tokens=1000, prompt_tokens_cached_prefill=100,
                      prompt_tokens_from_decode=800, kv_tier="host"),
        RequestRecord("c", 0, 3, 7, 0.0, warmup=False, input_num_tokens=1000, path="compute_on_decode",
                      decode_tokens_computed=100),  # D computed the new tokens on the history it held
    ]
    sources = leg_sources(result)
    assert sources["later_turns"] == 3
    assert sources["tokens"] == {"P pool": 300, "P host": 400, "D pool": 900, "D host": 800, "computed": 600}
    assert sources["turns_mostly_from"]["P host"] == 1 and sources["turns_mostly_from"]["D host"] == 1
