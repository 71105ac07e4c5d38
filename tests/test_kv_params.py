"""kv_transfer_params: vLLM NixlConnector's fields in, kvturn's out, and nothing malformed accepted."""
import pytest

from kvturn.kv_transfer.params import BadKVParams, KVTransferParams, plan, retention_params

VLLM_DECODE_RESULT = {  # what vLLM's decode worker returns after a normal finish (bidirectional mode)
    "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[4, 5, 6]],
    "remote_engine_id": "0f6a-engine", "remote_request_id": "cmpl-abc-0", "remote_host": "10.0.0.2",
    "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 41, "remote_blocks_expiry_time": 12345.5,
    "transfer_mode": "pull", "some_future_field": {"x": 1},
}


def test_vllm_fields_parse_and_round_trip():
    params = KVTransferParams.parse(VLLM_DECODE_RESULT)
    assert params.remote_block_ids == [4, 5, 6] and params.remote_num_tokens == 41 and params.names_peer
    out = params.to_json()
    assert {k: v for k, v in VLLM_DECODE_RESULT.items() if k != "some_future_field"} == out
    assert KVTransferParams.parse(out) == params


def test_for_next_prefill_flips_the_direction_and_can_cap_the_tokens():
    out = KVTransferParams.parse(VLLM_DECODE_RESULT).for_next_prefill(remote_num_tokens=32)
    assert out["do_remote_decode"] is True and out["do_remote_prefill"] is False
    assert out["remote_num_tokens"] == 32 and out["remote_block_ids"] == [[4, 5, 6]]


def test_kvturn_retention_params_carry_hashes_epochs_and_handle():
    lease = {"handle": "h", "block_ids": [1, 2], "block_hashes": [11, 22], "block_epochs": [3, 4],
             "num_tokens": 32, "expiry_time": 99.0}
    out = retention_params(lease, "engine", "req", "127.0.0.1", 8100, for_decode=False)
    parsed = KVTransferParams.parse(out)
    assert parsed.do_remote_decode and not parsed.do_remote_prefill
    assert (parsed.remote_block_hashes, parsed.remote_block_epochs, parsed.handle) == ([11, 22], [3, 4], "h")
    assert out["remote_block_ids"] == [[1, 2]]


@pytest.mark.parametrize("bad", [
    "not an object", {"remote_port": "80"}, {"remote_port": 70000}, {"remote_block_ids": [1, "2"]},
    {"remote_block_ids": [True]}, {"remote_blocks_expiry_time": float("nan")}, {"handle": 5},
    {"do_remote_decode": True, "do_remote_prefill": True}, {"remote_num_tokens": 1.5},
])
def test_malformed_params_are_refused(bad):
    with pytest.raises(BadKVParams):
        KVTransferParams.parse(bad)


def test_a_plan_binds_a_decode_lease_to_the_conversation_and_a_pin_to_the_request():
    lease = {"remote_host": "h", "remote_port": 1, "handle": "x", "remote_request_id": "p-req"}
    assert plan({**lease, "do_remote_decode": True}, "conv").remote.binding_key == "conv"
    assert plan({**lease, "do_remote_prefill": True}, "conv").remote.binding_key == "p-req"
    assert plan({**lease, "do_remote_decode": True}, None).remote is None  # no conversation: nothing to read
    with pytest.raises(BadKVParams, match="remote_host"):
        plan({"do_remote_prefill": True}, "conv")


def test_a_relayed_lease_record_is_trusted_only_whole_for_its_kind_holder_address_and_binding():
    """The MAC a holder puts in `binding` covers every field of the record and the address it advertises: change
    any (a store that relays the record rewrote its host or port), or present it for another conversation, another
    holder or the other kind of lease, and the record is not the holder's."""
    from kvturn.kv_transfer.params import RemoteRef
    from kvturn.kv_transfer.side_channel import LEASE, PIN, PeerClient
    holder, reader = PeerClient("s" * 32, 1.0, []), PeerClient("s" * 32, 1.0, [])
    record = {"handle": "h", "block_ids": [4, 5], "block_hashes": [11, 12], "block_epochs": [1, 1],
              "num_tokens": 32, "expiry_time": 1.5e9, "first_token_id": 7}
    bound = {**record, "binding": holder.binding(LEASE, "engine-d", "127.0.0.1:8200", "conv-a", record)}

    def ref(relayed, engine="engine-d", key="conv-a", host="127.0.0.1", port=8200):
        return RemoteRef(engine, host, port, relayed["handle"], key, relayed)

    assert reader.record_is_bound(ref(bound), LEASE)
    assert not reader.record_is_bound(ref(bound), PIN)
    assert not reader.record_is_bound(ref(bound, key="conv-b"), LEASE)
    assert not reader.record_is_bound(ref(bound, engine="engine-other"), LEASE)
    assert not reader.record_is_bound(ref(bound, port=9199), LEASE)
    assert not reader.record_is_bound(ref(bound, host="10.0.0.9"), LEASE)
    for field, value in [("block_ids", [4, 9]), ("block_epochs", [1, 2]), ("block_hashes", [11, 13]),
                         ("num_tokens", 31), ("expiry_time", 1.6e9), ("first_token_id", 8), ("handle", "g"),
                         ("tier", "host")]:
        assert not reader.record_is_bound(ref({**bound, field: value}), LEASE), field
    assert not PeerClient("t" * 32, 1.0, []).record_is_bound(ref(bound), LEASE)  # another cluster's secret
    assert not PeerClient(None, 1.0, []).record_is_bound(ref(bound), LEASE)  # no secret: never trusted relayed


def test_with_a_secret_only_a_signed_record_or_a_peer_given_at_start_up_may_be_contacted():
    """The secret is shown only to a peer the cluster named: a record its holder signed for this very address and
    binding, relayed by a caller of the cluster, or a --trusted-peer. A rewritten address, a record without its
    MAC, or any peer a caller without the secret names is declined before any contact."""
    from kvturn.kv_transfer import policy
    from kvturn.kv_transfer.params import RemoteRef
    from kvturn.kv_transfer.side_channel import LEASE, PeerClient
    record = {"handle": "h", "block_ids": [4], "block_hashes": [11], "block_epochs": [1], "num_tokens": 16,
              "expiry_time": 1.5e9, "first_token_id": None}
    signed = {**record, "binding": PeerClient("s" * 32, 1.0, []).binding(LEASE, "d", "10.0.0.2:8200", "c", record)}
    reader = PeerClient("s" * 32, 1.0, ["10.0.0.3:8300"])

    def ref(host, port, relayed):
        return RemoteRef("d", host, port, "h", "c", relayed)

    assert reader.may_contact(ref("10.0.0.2", 8200, signed), True, LEASE) is None
    assert reader.may_contact(ref("10.0.0.66", 8200, signed), True, LEASE) == policy.UNSIGNED_RECORD
    assert reader.may_contact(ref("10.0.0.2", 9199, signed), True, LEASE) == policy.UNSIGNED_RECORD
    assert reader.may_contact(ref("10.0.0.2", 8200, record), True, LEASE) == policy.UNSIGNED_RECORD
    assert reader.may_contact(ref("10.0.0.2", 8200, signed), False, LEASE) == policy.UNTRUSTED_PEER
    assert reader.may_contact(ref("10.0.0.3", 8300, None), False, LEASE) is None  # given at start-up
    assert PeerClient(None, 1.0, []).may_contact(ref("10.0.0.66", 1, None), False, LEASE) is None  # open cluster
