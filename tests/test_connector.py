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
from kvturn.kv_transfer.layered_reads import LAYERS_IN_FLIGHT
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


def recycle_as_the_read_starts(nixl, epochs, block_id: int) -> None:
    """Bump the peer's epoch of `block_id` (what handing the block out again does) as P posts its read, whole or
    layer by layer: P's look at the epochs just before the read saw them unchanged."""
    for name in ("start_block_read", "layer_reads"):
        def recycled(*args, _start=getattr(nixl, name), **kwargs):
            epochs[block_id] += 1
            return _start(*args, **kwargs)
        setattr(nixl, name, recycled)


def test_blocks_recycled_during_the_read_are_caught_by_the_epoch_check(pair, reference):
    decode, prefill, remote = pair
    recycle_as_the_read_starts(prefill.connector.nixl, decode.engine.block_manager.epochs, remote.block_ids[2])
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


class SlowLink:
    """Holds back what NIXL reports of a layered read, as a slow link would: layer l's transfer reads as in
    progress until `arrived` says it is in (the bytes themselves moved for real when it was posted)."""

    def __init__(self, nixl, fail_layer: int | None = None, stuck_layer: int | None = None):
        self.nixl, self.fail_layer, self.stuck_layer = nixl, fail_layer, stuck_layer
        self.layers: list = []  # handles of the layered read, in layer order
        self.arrived = 0
        self.looked_at: set = set()
        self.posted_with: list[tuple[int, int]] = []  # (layer posted, layers arrived by then)
        self.computed_with: list[tuple[int, int]] = []  # (layer about to compute, layers arrived by then)
        self._poll, self._layer_reads = nixl.poll, nixl.layer_reads
        nixl.poll, nixl.layer_reads = self.poll, self.layer_reads

    def layer_reads(self, *args):
        post = self._layer_reads(*args)

        def posted(layer):
            handle = post(layer)
            self.layers.append(handle)
            self.posted_with.append((layer, self.arrived))
            return handle
        return posted

    def poll(self, handle):
        if handle in self.layers:
            layer = self.layers.index(handle)
            if layer == self.fail_layer:
                return "ERR"
            if layer == self.stuck_layer:
                return "PROC"  # a peer that stopped mid-read
            if layer > self.arrived:
                return "PROC"  # layers arrive in order...
            if handle not in self.looked_at:
                self.looked_at.add(handle)
                return "PROC"  # ...each a look after the one before it
            state = self._poll(handle)
            self.arrived += state == "DONE"
            return state
        return self._poll(handle)


def computing_layers(node: Node, link: SlowLink) -> None:
    """Record, before each layer the engine computes, how many layers of the read had arrived."""
    run = node.engine.runner.run

    def recorded(batch, before_layer=None):
        def hook(layer):
            if before_layer is not None:
                before_layer(layer)
            link.computed_with.append((layer, link.arrived))
        return run(batch, hook)

    node.engine.runner.run = recorded


def test_a_layered_read_computes_each_layer_once_it_has_arrived_and_not_after_all(pair, reference):
    _, prefill, remote = pair
    link = SlowLink(prefill.connector.nixl)
    computing_layers(prefill, link)
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "reused" and seq.output_token_ids == reference
    layers = prefill.engine.kv_cache.layout.num_layers
    first_step = link.computed_with[:layers]
    assert [layer for layer, _ in link.posted_with] == list(range(layers))
    assert all(layer < arrived + LAYERS_IN_FLIGHT for layer, arrived in link.posted_with)  # a window, not all at once
    assert all(arrived > layer for layer, arrived in first_step)  # never computed on a layer still on its way
    assert first_step[0][1] < layers  # layer 0 computed while later layers were still arriving
    assert seq.timing.kv_read_s > 0 and seq.num_remote_tokens == len(remote.block_ids) * 16


def test_a_layer_that_fails_mid_read_makes_the_sequence_recompute_with_no_block_lost(pair, reference):
    _, prefill, remote = pair
    SlowLink(prefill.connector.nixl, fail_layer=1)
    free_before = prefill.engine.block_manager.num_free_blocks
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "read_failed" and seq.num_remote_tokens == 0
    assert seq.output_token_ids == reference
    for _ in range(100):
        prefill.engine.step()  # the abandoned read's blocks come back once NIXL is done with them
        if not prefill.connector.abandoned:
            break
    assert not prefill.connector.abandoned and prefill.engine.block_manager.num_free_blocks == free_before


def test_recycled_blocks_are_caught_after_a_layered_read_and_its_token_is_not_kept(pair, reference):
    decode, prefill, remote = pair
    SlowLink(prefill.connector.nixl)
    recycle_as_the_read_starts(prefill.connector.nixl, decode.engine.block_manager.epochs, remote.block_ids[-1])
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "epoch_mismatch" and seq.output_token_ids == reference


def test_with_overlap_off_the_history_is_read_whole_before_any_compute(model, reference):
    decode = Node(model)
    prefill = Node(model, prefix_caching=False)
    prefill.connector.config.kv_read_overlap = False
    turn = decode.run(Sequence("turn1", PROMPT[:150], PARAMS, retain=RetainSpec(60, "conv", False)))
    prefill.connector.nixl.add_peer(decode.connector.nixl.local_info())
    lease = turn.retained
    remote = RemoteBlocks(decode.connector.engine_id, lease["block_ids"], lease["block_hashes"],
                          lease["block_epochs"], lease["expiry_time"], lease["handle"], lease["num_tokens"])
    link = SlowLink(prefill.connector.nixl)
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "reused" and seq.output_token_ids == reference
    assert link.layers == [] and seq.timing.kv_read_hidden_s == 0


def test_a_layer_that_never_arrives_holds_the_step_only_so_long_then_the_prompt_recomputes(pair, reference):
    _, prefill, remote = pair
    prefill.connector.config.kv_read_layer_wait_s = 0.2
    SlowLink(prefill.connector.nixl, stuck_layer=2)
    seq = prefill.run(Sequence("next", PROMPT, PARAMS, remote=remote))
    assert seq.reuse_outcome == "peer_unreachable" and seq.num_remote_tokens == 0
    assert seq.output_token_ids == reference
    assert prefill.connector.abandoned  # its blocks stay out of use while NIXL may still write them
