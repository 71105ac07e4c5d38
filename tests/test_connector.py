"""The KV connector between two real engines over a real NIXL loopback: each reuse outcome the README lists,
and the output always equal to a plain recompute."""
import time

import pytest

from kvturn.config import ConnectorConfig, EngineConfig
from kvturn.engine.block_manager import block_hashes
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.kv_transfer.connector import KVConnector, RemoteBlocks, RetainSpec
from kvturn.model.loader import load_model

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [3 + (i * 37) % 3000 for i in range(200)]


class Node:
    def __init__(self, model, prefix_caching: bool = True):
        self.outputs: dict[str, list[int]] = {}
        self.engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, enable_prefix_caching=prefix_caching),
                                emit=self._collect, detokenize=lambda ids: "", eos_token_ids=set())
        self.connector = KVConnector(self.engine, ConnectorConfig(kv_recompute_threshold_tokens=16))

    def _collect(self, out):
        self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    def run(self, seq: Sequence) -> Sequence:
        self.engine.add_request(seq)
        deadline = time.monotonic() + 60
        while seq.request_id in self.engine.sequences and time.monotonic() < deadline:
            if not self.engine.step():
                time.sleep(0.001)
        assert seq.finish_reason is not None, "the request did not finish"
        return seq


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(model):
    node = Node(model, prefix_caching=False)
    return node.run(Sequence("ref", PROMPT, PARAMS)).output_token_ids


@pytest.fixture
def pair(model):
    """D retains a finished turn; P knows D over NIXL and gets D's lease record for the next prompt."""
    decode, prefill = Node(model), Node(model, prefix_caching=False)
    turn = decode.run(Sequence("turn1", PROMPT[:150], PARAMS, retain=RetainSpec(60, "conv", False)))
    prefill.connector.nixl.add_peer(decode.connector.nixl.local_info())
    lease = turn.retained
    remote = RemoteBlocks(decode.connector.engine_id, lease["block_ids"], lease["block_hashes"],
                          lease["block_epochs"], lease["expiry_time"], lease["handle"], lease["num_tokens"])
    return decode, prefill, remote


def test_matching_blocks_are_read_and_the_output_is_unchanged(pair, reference):
    _, prefill, remote = pair
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "reused" and seq.num_remote_tokens == len(remote.block_ids) * 16
    assert seq.output_token_ids == reference
    assert prefill.connector.stats.kv_read_bytes == len(remote.block_ids) * prefill.engine.kv_cache.layout.block_bytes


def test_blocks_recycled_during_the_read_are_caught_by_the_epoch_check(pair, reference):
    decode, prefill, remote = pair
    nixl = prefill.connector.nixl
    start_read = nixl.start_block_read

    def recycled_as_the_read_starts(*args, **kwargs):  # P's look at the epochs before the read saw them unchanged
        decode.engine.block_manager.epochs[remote.block_ids[2]] += 1  # what handing the block out again does
        return start_read(*args, **kwargs)

    nixl.start_block_read = recycled_as_the_read_starts
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "epoch_mismatch" and seq.num_remote_tokens == 0
    assert seq.output_token_ids == reference


def test_blocks_let_go_before_the_read_are_not_read_at_all(pair, reference):
    decode, prefill, remote = pair
    decode.engine.block_manager.epochs[remote.block_ids[2]] += 1  # let go while the prompt waited in P's queue
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    # seen before the read when NIXL brings the epochs back within the probe's wait, else by the read's own check
    assert seq.reuse_outcome in ("lease_ended", "epoch_mismatch") and seq.num_remote_tokens == 0
    assert seq.output_token_ids == reference


def test_an_edited_first_block_is_a_hash_mismatch(pair, reference, model):
    _, prefill, remote = pair
    edited = [7] + PROMPT[1:]
    seq = prefill.run(Sequence("edited", edited, PARAMS, remote=remote))
    assert seq.reuse_outcome == "hash_mismatch" and seq.num_remote_tokens == 0
    assert seq.output_token_ids == Node(model, prefix_caching=False).run(Sequence("r", edited, PARAMS)).output_token_ids


def test_a_failed_read_recomputes(pair, reference):
    _, prefill, remote = pair
    remote.block_ids = [10_000 + b for b in remote.block_ids]  # outside the peer's registered pool
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "read_failed" and seq.num_remote_tokens == 0
    assert seq.output_token_ids == reference


def test_blocks_in_the_local_prefix_cache_are_not_read(model, reference):
    decode, prefill = Node(model), Node(model, prefix_caching=True)
    turn = decode.run(Sequence("turn1", PROMPT[:150], PARAMS, retain=RetainSpec(60, "conv", False)))
    prefill.connector.nixl.add_peer(decode.connector.nixl.local_info())
    prefill.run(Sequence("warm", PROMPT, PARAMS))
    lease = turn.retained
    remote = RemoteBlocks(decode.connector.engine_id, lease["block_ids"], lease["block_hashes"],
                          lease["block_epochs"], lease["expiry_time"], lease["handle"], lease["num_tokens"])
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "covered_locally" and seq.num_remote_tokens == 0
    assert seq.num_cached_tokens >= len(block_hashes(PROMPT[:150], 16)) * 16
    assert seq.output_token_ids == reference
