"""The planner's model of a worker against the worker's own code: the same requests through the engine's real
Scheduler and through the simulation's step loop make the same prompt steps (which prompts, how many tokens of
each, beside how many decodes); the same retains, expiries and pool pressure through the decode worker's real
LeaseTable (its clock injected) and through the simulation's leases leave the same leases alive in the same tiers."""
from pathlib import Path

import pytest

from kvturn.bench.catalog import LEGS
from kvturn.engine.block_manager import BlockManager
from kvturn.engine.kv_cache import LAYER_MAJOR, KVCache, KVLayout
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.scheduler import Scheduler
from kvturn.engine.sequence import Sequence
from kvturn.kv_transfer.host_tier import HostTier
from kvturn.kv_transfer.leases import LeaseTable
from kvturn.plan import calibration
from kvturn.plan.retention import Leases
from kvturn.plan.sim import Deployment, Simulation
from kvturn.plan.steps import Job
from kvturn.plan.trace import Workload

BLOCK = 16
# (name, prompt tokens, tokens to generate): long prompts chunked, short ones packed, decodes beside them
REQUESTS = [("a", 700, 6), ("b", 300, 40), ("c", 90, 3), ("d", 1500, 2), ("e", 40, 30), ("f", 260, 5),
            ("g", 33, 12), ("h", 900, 4)]
LIMITS = [dict(max_num_seqs=4, max_num_batched_tokens=512, prefill_pack_tokens=256),
          dict(max_num_seqs=8, max_num_batched_tokens=1024, prefill_pack_tokens=1024),
          dict(max_num_seqs=3, max_num_batched_tokens=256, prefill_pack_tokens=64)]


def engine_prompt_steps(limits: dict) -> list[tuple]:
    """Each step with prompt tokens in it, as the engine's Scheduler makes it: (steps with decodes before it, (name,
    tokens) of each prompt, decodes beside). The first request arrives alone, the others while its first step runs."""
    scheduler = Scheduler(BlockManager(4096, BLOCK, enable_prefix_caching=False), limits["max_num_seqs"],
                          limits["max_num_batched_tokens"], reclaim_retained=lambda _seq: False,
                          prefill_pack_tokens=limits["prefill_pack_tokens"])
    sequences = [Sequence(name, [1000 * i + t for t in range(prompt)], SamplingParams(max_tokens=out))
                 for i, (name, prompt, out) in enumerate(REQUESTS)]
    scheduler.add(sequences[0])
    steps, first, decoded = [], True, 0
    while scheduler.has_work():
        batch = scheduler.schedule(lambda seq, hashes: None)
        if first:
            for seq in sequences[1:]:
                scheduler.add(seq)
            first = False
        prompts = [(seq.request_id, n) for seq, n in batch if seq.num_output_tokens == 0]
        if prompts:
            steps.append((decoded, sorted(prompts), len(batch) - len(prompts)))
        decoded += len(batch) > len(prompts)
        for seq, n in batch:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):  # the step sampled its next token
                seq.token_ids.append(1)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    scheduler.remove(seq)
    return steps


class Recording(Simulation):
    """The simulation, noting each prompt step its workers run (each is priced as it is scheduled)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.prompt_steps: list[tuple] = []

    def prompt_step_ms(self, loop, chunks: list) -> float:
        self.prompt_steps.append((loop.steps, sorted((job.flight, n) for job, n in chunks), len(loop.decoding)))
        return super().prompt_step_ms(loop, chunks)


def planner_prompt_steps(limits: dict) -> list[tuple]:
    fixture = calibration.load(Path(__file__).parent / "fixtures" / "plan_bench_results.json")
    deployment = Deployment(**limits)
    sim = Recording(Workload("none", [], None), LEGS["colocated"], deployment, fixture)
    loop = sim.decode[0]
    for name, prompt, out in REQUESTS:
        sim.at(0.0, loop.submit_prefill, Job(prompt, 0, out, flight=name))
    sim.run()
    return sim.prompt_steps


@pytest.mark.parametrize("limits", LIMITS, ids=["packed", "roomy", "tight"])
def test_the_simulated_step_loop_schedules_prompts_as_the_engines_scheduler_does(limits):
    assert planner_prompt_steps(limits) == engine_prompt_steps(limits)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# (seconds from the start, what happens): retain a conversation's blocks, or the pool needs one lease's room
EVENTS = [(0, "retain", "a", 4), (1, "retain", "b", 3), (2, "retain", "c", 2), (3, "retain", "a", 5),
          (4, "pressure"), (5, "retain", "d", 6), (6, "retain", "e", 1), (7, "pressure"), (8, "retain", "b", 2),
          (30, "retain", "f", 3), (31, "pressure"), (45, "retain", "c", 4), (62, "retain", "g", 2), (63, "pressure"),
          (70, "retain", "h", 9), (90, "retain", "a", 2)]


@pytest.mark.parametrize("budget_blocks, host_blocks", [(8, 6), (8, 0), (None, 5), (12, 20)])
def test_the_simulated_leases_move_and_drop_as_the_decode_workers_lease_table(budget_blocks, host_blocks):
    ttl_s, clock = 40.0, Clock()
    blocks = BlockManager(256, BLOCK)
    layout = KVLayout("tiny", "float32", 256, BLOCK, 1, 1, 4, LAYER_MAJOR)
    pool = KVCache(layout)
    real = LeaseTable(blocks, budget_blocks, HostTier(pool, host_blocks) if host_blocks else None, pool,
                      clock=clock)
    planned = Leases(None if budget_blocks is None else budget_blocks * BLOCK, host_blocks * BLOCK,
                     lambda tier, tokens: None)
    conversations = sorted({event[2] for event in EVENTS if event[1] == "retain"})
    for at_s, what, *args in EVENTS:
        clock.now = 1000.0 + at_s
        real.expire()
        planned.expire(at_s)
        if what == "retain":
            conversation, count = args
            ids = [blocks.allocate_new() for _ in range(count)]
            real.retain(ids, list(range(count)), count * BLOCK, conversation, ttl_s, release_after_read=False)
            blocks.release_all(ids)  # the request finished: only the lease holds them
            planned.retain(conversation, count * BLOCK, at_s, ttl_s)
        else:
            assert real.reclaim_oldest() == planned.reclaim_oldest()
        alive = {c: lease.tier for c in conversations if (lease := real.for_conversation(c)) is not None}
        assert alive == {c: tier for c in conversations if (tier := planned.tier_of(c)) is not None}, (at_s, what)
        assert planned.tokens == {"pool": real.blocks_in("pool") * BLOCK, "host": real.blocks_in("host") * BLOCK}
