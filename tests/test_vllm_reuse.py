"""The token-space check the router puts in front of vLLM's positional KV reuse (pure; no processes)."""
import random

from kvturn.router import vllm_reuse as reuse
from kvturn.router.vllm_reuse import (
    common_prefix_len,
    retained_token_ids,
    verified_reuse,
)

BLOCK = 128


def history(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def text(ids: list[int]) -> str:
    """Ids as the router keeps them, the inside of vLLM's JSON list."""
    return ",".join(map(str, ids))


def check(retained: list[int], new_prompt: list[int], claimed: int, block: int, threshold: int):
    return verified_reuse(text(retained), text(new_prompt), claimed, block, threshold)


def test_common_prefix_len_finds_the_first_difference_anywhere():
    base = history(3000)
    for cut in (0, 1, 255, 256, 257, 1000, 2999):
        other = base[:cut] + [base[cut] + 1] + base[cut + 1:]
        assert common_prefix_len(text(base), text(other)) == cut
    assert common_prefix_len(text(base), text(base)) == 3000
    assert common_prefix_len(text(base), text(base[:700])) == 700
    assert common_prefix_len("", text(base)) == 0


def test_an_id_that_only_starts_like_another_is_a_difference():
    assert common_prefix_len("7,12,3", "7,123") == 1
    assert common_prefix_len("7,123", "7,12") == 1
    assert common_prefix_len("7,12", "7,12,5") == 2
    assert common_prefix_len("12", "1") == 0


def test_retained_tokens_are_prompt_and_answer_cut_at_what_decode_holds():
    assert retained_token_ids("1,2,3", "4,5,6", 5) == "1,2,3,4,5"
    assert retained_token_ids("1,2,3", None, 3) == "1,2,3"
    assert retained_token_ids("1,2,3", "4", 2) == "1,2"
    assert retained_token_ids("1,2,3", "4", 9) == "1,2,3,4"
    assert retained_token_ids(None, "4", 3) is None
    assert retained_token_ids("1,2", "3", 0) is None


def test_an_extended_history_passes_whole_blocks_of_the_retained_tokens():
    retained = history(1000)
    new_prompt = retained + history(200, seed=1)
    tokens, outcome, verified = check(retained, new_prompt, 1000, BLOCK, 64)
    assert (tokens, outcome, verified) == (896, reuse.PASSED, 1000)


def test_a_prompt_that_diverges_inside_the_retained_tokens_is_capped_at_the_verified_prefix():
    retained = history(1000)
    new_prompt = retained[:673] + [9999] + retained[674:] + history(50, seed=2)
    tokens, outcome, verified = check(retained, new_prompt, 1000, BLOCK, 64)
    assert (tokens, outcome, verified) == (640, reuse.CAPPED, 673)


def test_never_more_than_decode_claims_even_if_more_ids_are_known():
    retained = history(1000)
    tokens, outcome, verified = check(retained, retained + [1], 300, BLOCK, 64)
    assert (tokens, outcome, verified) == (256, reuse.PASSED, 300)


def test_never_more_than_the_new_prompt_holds():
    retained = history(1000)
    tokens, outcome, _ = check(retained, retained[:500], 1000, BLOCK, 64)
    assert (tokens, outcome) == (384, reuse.PASSED)


def test_an_edit_near_the_start_is_refused_as_a_mismatch():
    retained = history(1000)
    edited = [retained[0], 7] + retained[2:]
    assert check(retained, edited, 1000, BLOCK, 64) == (0, reuse.REFUSED_MISMATCH, 1)


def test_a_short_history_that_matches_is_refused_below_the_threshold():
    retained = history(100)
    assert check(retained, retained + [5, 6], 100, BLOCK, 64) == (0, reuse.REFUSED_BELOW_THRESHOLD, 100)
    # a whole block that is still below a larger threshold
    retained = history(200)
    assert check(retained, retained, 200, BLOCK, 150) == (0, reuse.REFUSED_BELOW_THRESHOLD, 200)


def test_a_verified_prefix_shorter_than_one_block_passes_nothing_even_with_no_threshold():
    retained = history(1000)
    new_prompt = retained[:100] + [1]
    assert check(retained, new_prompt, 1000, BLOCK, 0) == (0, reuse.REFUSED_MISMATCH, 100)


def test_the_passed_tokens_never_exceed_the_verified_prefix_nor_the_claim():
    rng = random.Random(7)
    for _ in range(300):
        retained = history(rng.randrange(1, 2000), seed=rng.randrange(10**6))
        cut = rng.randrange(len(retained) + 1)
        new_prompt = retained[:cut] + history(rng.randrange(0, 300), seed=rng.randrange(10**6))
        claimed = rng.randrange(1, len(retained) + 1)
        block, threshold = rng.choice((16, 128)), rng.choice((0, 64))
        tokens, _, verified = check(retained, new_prompt, claimed, block, threshold)
        shared = next((i for i, (a, b) in enumerate(zip(retained, new_prompt)) if a != b),
                      min(len(retained), len(new_prompt)))
        assert verified == min(shared, claimed)
        assert tokens % block == 0 and tokens <= verified <= claimed
        assert new_prompt[:tokens] == retained[:tokens]


D_PARAMS = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7]],
            "remote_engine_id": "ac100522", "remote_request_id": "chatcmpl-turn1-abc-a5315ed7",
            "remote_host": "127.0.0.1", "remote_port": 15700, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": 838, "remote_blocks_expiry_time": 1247.399074056, "transfer_mode": "pull"}


def test_prefill_gets_decode_params_unchanged_but_for_the_flags_and_the_verified_count():
    from kvturn.router.vllm_params import params_for_prefill, stored_params
    stored = stored_params(D_PARAMS | {"do_remote_decode": False, "do_remote_prefill": True}, lease_end=None)
    assert params_for_prefill(stored, 640) == D_PARAMS | {"remote_num_tokens": 640}


def test_the_table_never_reads_decodes_monotonic_expiry_as_wall_clock():
    from kvturn.router.vllm_params import stored_params
    assert stored_params(D_PARAMS)["remote_blocks_expiry_time"] is None
    assert stored_params(D_PARAMS, lease_end=2e9)["remote_blocks_expiry_time"] == 2e9


def test_token_id_lists_are_cut_out_of_vllms_json_and_kept_as_text():
    import json

    from kvturn.router.fast_json import checked_ids, cut_int_list, encode_with, ids_text
    chunk = {"id": "c", "choices": [{"delta": {"content": 'say "prompt_token_ids":[9]'}}], "prompt_token_ids": [1, 2, 3]}
    rest, ids = cut_int_list(json.dumps(chunk, separators=(",", ":")), "prompt_token_ids")
    assert json.loads(rest) == {"id": "c", "choices": chunk["choices"]} and ids == "1,2,3" == ids_text([1, 2, 3])
    first = json.dumps({"prompt_token_ids": [4, 5], "id": "x"}, separators=(",", ":"))
    rest, ids = cut_int_list(first, "prompt_token_ids")
    assert json.loads(rest) == {"id": "x"} and ids == "4,5"
    spaced = json.dumps({"prompt_token_ids": [4, 5]})  # not vLLM's form: left whole for json to parse
    assert cut_int_list(spaced, "prompt_token_ids") == (spaced, None)
    assert cut_int_list('{"prompt_token_ids":null}', "prompt_token_ids") == ('{"prompt_token_ids":null}', None)
    assert checked_ids("") == "" and checked_ids("40,1") == "40,1"
    assert [checked_ids(t) for t in ("1, 2", "1,2.5", "1,,2", ",1", "1,", "-1", '"1"', "true")] == [None] * 8
    assert ids_text([]) == "" and [ids_text(v) for v in ([1, True], [1.0], [-1], None, "1,2")] == [None] * 5
    body = {"model": "m", "messages": [{"role": "user", "content": "é\""}], "max_tokens": 1}
    assert json.loads(encode_with(body, "messages", json.dumps(body["messages"]).encode())) == body
    assert json.loads(encode_with({"messages": []}, "messages", b"[]")) == {"messages": []}
