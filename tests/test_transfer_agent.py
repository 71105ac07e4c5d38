"""NIXL agents in one process: handshake checks and block reads land the right bytes."""
import time

import numpy as np
import pytest
import torch

from kvturn.config import ConnectorConfig, EngineConfig
from kvturn.engine.kv_cache import KVCache, KVLayout
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.kv_transfer.connector import KVConnector, RetainSpec
from kvturn.kv_transfer.nixl_agent import DONE, IN_PROGRESS, KVTransferAgent, LayoutMismatch
from kvturn.model.config import ModelConfig
from kvturn.model.loader import load_model


def agent(model_dir, block_size=16, blocks=8):
    kv = KVCache(KVLayout.for_model(ModelConfig.from_dir(model_dir), blocks, block_size))
    return KVTransferAgent(kv, np.zeros(blocks, dtype=np.int64)), kv


def test_a_peer_with_another_kv_layout_is_refused_with_the_differing_field(tiny_model_dir):
    ours, _ = agent(tiny_model_dir, block_size=16)
    theirs, _ = agent(tiny_model_dir, block_size=32)
    with pytest.raises(LayoutMismatch, match="block_size"):
        ours.add_peer(theirs.local_info())
    assert theirs.engine_id not in ours.peers


def test_scattered_block_reads_copy_exactly_the_named_blocks(tiny_model_dir):
    ours, our_kv = agent(tiny_model_dir)
    theirs, their_kv = agent(tiny_model_dir)
    their_kv.pool.normal_()
    theirs.epochs[:] = np.arange(8) + 100
    ours.add_peer(theirs.local_info())
    for handle in (ours.start_block_read(theirs.engine_id, [5, 2, 3], [0, 6, 7]),
                   ours.start_epoch_read(theirs.engine_id, [5, 2, 3], [0, 6, 7])):
        while (state := ours.poll(handle)) == IN_PROGRESS:
            time.sleep(0.001)
        ours.release(handle)
        assert state == DONE
    for local, remote in ((0, 5), (6, 2), (7, 3)):
        assert torch.equal(our_kv.block(local), their_kv.block(remote))
    assert not our_kv.block(1).any()
    assert ours.scratch_epochs([0, 6, 7]) == [105, 102, 103]


def test_running_requests_reclaim_retained_blocks_before_anyone_is_preempted(tiny_model_dir):
    engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_kv_blocks=24), emit=lambda out: None,
                       detokenize=lambda ids: "", eos_token_ids=set())
    leases = KVConnector(engine, ConnectorConfig()).leases
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    turns = []
    for i in range(3):  # three finished turns retain 6 blocks each: 18 of 24 blocks leased, 6 free
        turns.append(Sequence(f"turn{i}", [3 + i * 100 + t for t in range(97)], params,
                              retain=RetainSpec(480, f"conv{i}", False)))
        engine.add_request(turns[-1])
        while engine.has_work():
            engine.step()
    assert leases.retained_blocks == 18
    # 250 prompt + 20 answer tokens need 17 blocks: two leases must go, the oldest two
    engine.add_request(Sequence("big", [7] * 250, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    assert leases.counts["reclaimed"] == 2 and engine.scheduler.num_preemptions == 0
    alive = [leases.lookup(t.retained["handle"], f"conv{i}") is not None for i, t in enumerate(turns)]
    assert alive == [False, False, True]


def test_a_peer_whose_pool_is_block_major_is_refused(tiny_model_dir):
    """A peer from before the pool was layer-major names no order in its layout: its blocks are laid out otherwise,
    and reading them as ours would be garbage."""
    ours, _ = agent(tiny_model_dir)
    theirs, _ = agent(tiny_model_dir)
    info = theirs.local_info()
    del info["layout"]["order"]
    with pytest.raises(LayoutMismatch, match="order"):
        ours.add_peer(info)
