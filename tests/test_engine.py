"""Greedy outputs through every cache path equal a full recompute and an independent implementation."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvturn.config import EngineConfig
from kvturn.engine.llm import LLM
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.engine.step_history import StepHistory, StepRecord, since, step_record

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [37, 130, 5, 64, 200, 17, 48, 91]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def uncached(tiny_model_dir, prompts):
    """Each prompt alone, prefix caching off: the full-recompute reference."""
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32, enable_prefix_caching=False))
    outputs = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert llm.engine.stats.prompt_tokens_cached == 0
    return outputs


def test_cached_prefix_gives_the_same_tokens(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32))
    first = [llm.generate([p], GREEDY)[0] for p in prompts]
    cached_before = llm.engine.stats.prompt_tokens_cached
    second = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert llm.engine.stats.prompt_tokens_cached - cached_before >= sum(n // 16 * 16 - 16 for n in PROMPT_LENGTHS)
    assert first == uncached and second == uncached


def test_extended_prompt_reuses_prefix_and_matches(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32))
    history = prompts[4] + uncached[4]
    llm.generate([prompts[4]], GREEDY)
    reference = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32, enable_prefix_caching=False))
    assert llm.generate([history + [11, 12, 13]], GREEDY) == reference.generate([history + [11, 12, 13]], GREEDY)
    assert llm.engine.stats.prompt_tokens_cached >= 192


def test_batch_of_eight_gives_the_same_tokens(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32, enable_prefix_caching=False))
    assert llm.generate(prompts, GREEDY) == uncached


def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32, max_num_batched_tokens=40))
    assert llm.generate(prompts, GREEDY) == uncached


def test_prompts_share_a_step_only_up_to_the_pack_limit(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32, enable_prefix_caching=False, prefill_pack_tokens=100))
    steps, run = [], llm.engine.runner.run

    def recorded(batch, before_layer=None):
        steps.append([(seq.num_computed_tokens, n) for seq, n in batch if seq.num_output_tokens == 0])
        return run(batch, before_layer)

    llm.engine.runner.run = recorded
    assert llm.generate(prompts, GREEDY) == uncached
    # 37 tokens leave 63 under the limit: the 130-token prompt computes those and goes on in the next step.
    assert [n for _, n in steps[0]] == [37, 63] and steps[1][0] == (63, 67)
    for chunks in steps:  # prompts share a step only up to the limit; one alone (or going on) may take more
        assert len(chunks) <= 1 or sum(n for _, n in chunks) <= 100


def test_prompts_whose_history_was_read_join_a_step_only_up_to_the_pack_limit():
    """Reads that end while a step runs hand the engine several prompts at once: they share the next step as prompts
    from the queue do, up to the pack limit, rather than all computing in one long step."""
    from kvturn.engine.block_manager import BlockManager
    from kvturn.engine.scheduler import Scheduler
    from kvturn.engine.sequence import Status
    scheduler = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=4096, reclaim_retained=lambda _seq: False, prefill_pack_tokens=100)
    pulled = [Sequence(f"pulled-{i}", [3 + (i * 7 + t) % 50 for t in range(200)], GREEDY, remote=object())
              for i in range(3)]

    def admit(seq, hashes):
        seq.status = Status.LOADING_KV  # its first 160 tokens' KV is read from a peer

    for seq in pulled:
        scheduler.add(seq)
    assert scheduler.schedule(admit) == [] and scheduler.loading == pulled
    for seq in pulled:
        seq.num_computed_tokens = 160
        scheduler.finish_loading(seq)
    step = scheduler.schedule(admit)
    # 40 new tokens each: the first alone could take the whole budget; the others get what the limit leaves.
    assert [(seq.request_id, n) for seq, n in step] == [("pulled-0", 40), ("pulled-1", 40), ("pulled-2", 20)]
    for seq, n in step:  # the step ran: the first two sampled their first token
        seq.num_computed_tokens += n
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(5)
    assert [(seq.request_id, n) for seq, n in scheduler.schedule(admit)] == [
        ("pulled-0", 1), ("pulled-1", 1), ("pulled-2", 20)]
    # A single token left under the limit is a prompt's token too: the next prompt does not join for free.
    scheduler = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_num_seqs=8,
                          max_num_batched_tokens=4096, reclaim_retained=lambda _seq: False, prefill_pack_tokens=100)
    going_on = Sequence("going-on", [3 + t % 50 for t in range(299)], GREEDY)
    scheduler.add(going_on)
    assert [n for _, n in scheduler.schedule(lambda seq, hashes: None)] == [299]
    going_on.num_computed_tokens = 200  # as if preempted work came back: 99 tokens of its prompt to go
    pulled = [Sequence(f"pulled-{i}", [3 + (i * 7 + t) % 50 for t in range(200)], GREEDY, remote=object())
              for i in range(2)]
    for seq in pulled:
        scheduler.add(seq)
    scheduler.schedule(admit)  # their reads start
    for seq in pulled:
        seq.num_computed_tokens = 160
        scheduler.finish_loading(seq)
    assert [(seq.request_id, n) for seq, n in scheduler.schedule(admit)] == [("going-on", 99), ("pulled-0", 1)]


def test_a_prompt_whose_read_is_done_when_posted_computes_in_the_step_that_started_the_read():
    """Over shared memory a read is done when its post returns. The scheduler polls the reads it has just started and
    lets those done join the same step (under the pack limit), rather than leaving them to the next step: on a busy
    prefill worker that step would be a whole step of others' prompts later."""
    from kvturn.engine.block_manager import BlockManager
    from kvturn.engine.scheduler import Scheduler
    from kvturn.engine.sequence import Status

    def admit(seq, hashes):
        if seq.remote is not None:
            seq.status = Status.LOADING_KV  # its first 160 tokens' KV is read from a peer

    for polled in (True, False):
        scheduler = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_num_seqs=8,
                              max_num_batched_tokens=4096, reclaim_retained=lambda _seq: False, prefill_pack_tokens=100)
        pulled = [Sequence(f"pulled-{i}", [3 + (i * 7 + t) % 50 for t in range(200)], GREEDY, remote=object())
                  for i in range(2)]
        for seq in (Sequence("local", [3 + t % 50 for t in range(60)], GREEDY), *pulled):
            scheduler.add(seq)

        def poll():  # the first read is done, the second is not
            pulled[0].num_computed_tokens = 160
            scheduler.finish_loading(pulled[0])

        step = [(seq.request_id, n) for seq, n in scheduler.schedule(admit, poll if polled else None)]
        assert step == ([("local", 60), ("pulled-0", 40)] if polled else [("local", 60)])
        assert scheduler.loading == pulled[1:] if polled else pulled


def test_preemption_under_block_pressure_gives_the_same_tokens(tiny_model_dir, prompts, uncached):
    # 40 blocks of 16 tokens cannot hold all eight sequences at once (they need 49).
    llm = LLM(tiny_model_dir, EngineConfig(num_kv_blocks=40, max_num_batched_tokens=256))
    assert llm.generate(prompts, GREEDY) == uncached
    assert llm.engine.scheduler.num_preemptions > 0


def test_transformers_greedy_generate_agrees(tiny_model_dir, prompts, uncached):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt, ours in zip(prompts[:4], uncached[:4]):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out[0, len(prompt):].tolist() == ours


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed(tiny_model_dir, prompts):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=16))
    params = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=seed,  # noqa
                                         ignore_eos=True)
    a, b, c = (llm.generate([prompts[0]], params(s))[0] for s in (1, 1, 2))
    assert a == b and a != c


def test_top_k_one_is_greedy(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=16))
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=1, seed=0, ignore_eos=True)
    assert llm.generate([prompts[1]], params)[0] == uncached[1]


def test_stop_token_and_max_tokens_end_generation(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=16))
    stop_at = uncached[2][5]
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out == uncached[2][:uncached[2].index(stop_at) + 1]
    assert llm.generate([prompts[2]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0] == uncached[2][:3]


def test_stop_string_ends_generation(tiny_model_dir, prompts, uncached):
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=16))
    text = llm.tokenizer.decode(uncached[3][:6])
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert len(out) <= 6 and stop in llm.tokenizer.decode(out)


def test_a_sequence_never_outgrows_the_pool(tiny_model_dir):
    llm = LLM(tiny_model_dir, EngineConfig(num_kv_blocks=8))  # 128 tokens of KV
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))[0]
    assert llm.engine.max_model_len == 128 and len(out) == 28


def test_a_sequence_continues_from_a_first_token_sampled_elsewhere(tiny_model_dir, prompts, uncached):
    """A decode worker continues from the token P sampled (the router may have sent it to the client already)
    instead of sampling its own, and the rest is the model's own continuation of that token."""
    llm = LLM(tiny_model_dir, EngineConfig(kv_cache_mb=32, enable_prefix_caching=False))
    forced = (uncached[1][0] + 1) % 4000
    seq = Sequence("forced", prompts[1], GREEDY)
    seq.first_token_id = forced
    llm.engine.add_request(seq)
    while llm.engine.has_work():
        llm.engine.step()
    rest = llm.generate([prompts[1] + [forced]], SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True))[0]
    assert seq.output_token_ids == [forced] + rest


def test_start_up_calibration_times_what_the_pool_holds_within_its_budget(tiny_model_dir, monkeypatch):
    from kvturn.engine import calibration
    llm = LLM(tiny_model_dir, EngineConfig(num_kv_blocks=200))  # 3200 tokens: the 4096-token chain cannot fit
    free = llm.engine.block_manager.num_free_blocks
    # a budget and a lock wait no loaded machine runs out of: which chains fit is what is checked here
    monkeypatch.setattr(calibration, "BUDGET_S", 600.0)
    monkeypatch.setattr(calibration, "LOCK_WAIT_S", 600.0)
    steps = calibration.time_prefill_steps(llm.engine)
    assert [(s["new_tokens"], s["context_tokens"]) for s in steps] == [(512, 0), (2048, 0), (256, 2048)]
    assert all(s["ms"] > 0 for s in steps) and llm.engine.block_manager.num_free_blocks == free
    monkeypatch.setattr(calibration, "BUDGET_S", 0.0)  # a model too slow for the budget: the first chain only
    assert [s["new_tokens"] for s in calibration.time_prefill_steps(llm.engine)] == [512]
    import fcntl
    monkeypatch.setattr(calibration, "LOCK_WAIT_S", 0.2)
    with open(calibration.LOCK, "a") as neighbour:  # a worker stopped while it held the lock
        fcntl.flock(neighbour, fcntl.LOCK_EX)
        assert [s["new_tokens"] for s in calibration.time_prefill_steps(llm.engine)] == [512]


def step(started_s: float) -> StepRecord:
    return StepRecord(started_s, 1.0, 1.0, ((32, 0),), 0, 0, 0)


def test_the_step_history_says_a_span_lost_steps_only_when_one_of_it_was_dropped():
    history = StepHistory(3)
    for started_s in (1.0, 2.0, 3.0):
        history.record(step(started_s))
    assert since(history.snapshot(), 1.0) == ([step(1.0), step(2.0), step(3.0)], False)  # full, nothing dropped
    history.record(step(4.0))  # drops the step of 1.0
    assert since(history.snapshot(), 1.5) == ([step(2.0), step(3.0), step(4.0)], False)
    assert since(history.snapshot(), 1.0) == ([step(2.0), step(3.0), step(4.0)], True)


def test_a_step_record_splits_prompts_from_decodes_as_the_model_runner_does():
    # A preempted sequence that recomputes its output with its prompt is a prompt chunk, not a decode of that
    # length; a decode's context is the KV it attends to before the step.
    prompt, recomputing, decoding = (Sequence(f"s{i}", list(range(3, 103)), GREEDY) for i in range(3))
    recomputing.token_ids += [5, 6]
    recomputing.num_computed_tokens = 0
    decoding.token_ids += [7]
    decoding.num_computed_tokens = 100
    record = step_record([(prompt, 64), (recomputing, 102), (decoding, 1)], 10.0, 0.002, 0.0015)
    assert record.prompts == ((64, 0), (102, 0))
    assert (record.decodes, record.decode_context, record.decode_longest) == (1, 100, 100)
    assert (record.started_s, record.ms, record.cpu_ms) == (10.0, 2.0, 1.5)
