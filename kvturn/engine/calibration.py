"""How fast this engine computes prompts on this machine, timed once before it serves.

A router predicts each turn's path from its measured compute (kvturn/costmodel); with no request seen yet, a
fresh cluster would predict its first turns from a prior written for some other machine. Each worker instead
times a few prefill steps at start-up, from scratch and on top of a context, and serves them at
`/kv/calibration`; a router fits them into the prior of its cost model. Workers on one machine take turns (a
lock file): two timing their steps at once would each measure the other's load, 2-20x the time alone. The steps run
with the worker's NIXL agent started, as in service: without its threads they ran 5-8% faster.

The steps run back to back. A served turn often starts on a worker that sat idle, its caches holding what ran
meanwhile, and runs slower; kvturn plan fits the steps a worker ran in service instead, which hold that.
"""
import fcntl
import logging
import tempfile
import time
from pathlib import Path

from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence

log = logging.getLogger("kvturn.engine")

# Chains of steps, each (new tokens) computed on top of the chain's earlier ones: prompts from scratch of three
# sizes, and a few hundred tokens on top of 2k and 4k tokens of context (an agent's turn on a retained history).
CHAINS = ((512,), (2048, 256), (4096, 256))
REPEATS = 2  # of each step; a process starting beside this one (imports, loading) may slow one of them
BUDGET_S = 5.0  # past this, no further chain starts: a large model on a CPU is timed on the first chains only
LOCK = Path(tempfile.gettempdir()) / "kvturn-calibration.lock"
LOCK_WAIT_S = 30.0


def time_prefill_steps(engine: LLMEngine, chains=CHAINS) -> list[dict]:
    """[{new_tokens, context_tokens, ms}] of one forward step each, on arbitrary tokens, before any request. A chain
    that the KV pool or the model's length cannot hold is left out, and so are the chains that would start after
    BUDGET_S; the first step is run once more before it is timed (the first run of a shape allocates), and each
    step twice, of which the faster counts."""
    try:
        lock = open(LOCK, "a")
    except OSError:  # another user's file: time the steps untidily rather than not at all
        return _time_prefill_steps(engine, chains)
    with lock:  # the lock goes with the file
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # a stopped neighbour must not keep this worker from starting
                    log.warning("prefill calibration: %s held for %.0f s; timing without it", LOCK, LOCK_WAIT_S)
                    break
                time.sleep(0.05)
        return _time_prefill_steps(engine, chains)


def _time_prefill_steps(engine: LLMEngine, chains) -> list[dict]:
    runner, blocks, block_size = engine.runner, engine.block_manager, engine.block_manager.block_size
    vocab = runner.model.config.vocab_size
    room = min(engine.max_model_len - 1, blocks.num_free_blocks * block_size)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    samples, warmed, started_s = [], False, time.perf_counter()
    for chain in chains:
        total = sum(chain)
        if samples and time.perf_counter() - started_s > BUDGET_S:
            log.info("prefill calibration stopped after %.1f s, before the %d-token steps", BUDGET_S, total)
            break
        if total > room:
            continue
        # One more token than computed: the steps never reach the prompt's end, so none samples a token.
        seq = Sequence(f"calibration-{total}", [(7919 * i) % (vocab - 3) + 3 for i in range(total + 1)], params)
        seq.block_table = [blocks.allocate_new() for _ in range(seq.blocks_needed(block_size, total))]
        try:
            for new_tokens in chain:
                if not warmed:
                    runner.run([(seq, new_tokens)])
                    warmed = True
                times = []
                for _ in range(REPEATS):  # the same step again writes the same KV: the fastest is the machine's
                    started = time.perf_counter()
                    runner.run([(seq, new_tokens)])
                    times.append((time.perf_counter() - started) * 1e3)
                samples.append({"new_tokens": new_tokens, "context_tokens": seq.num_computed_tokens, "ms": min(times)})
                seq.num_computed_tokens += new_tokens
        finally:
            blocks.release_all(seq.block_table)
    log.info("prefill calibration: %s", ", ".join(f"{s['new_tokens']}@{s['context_tokens']}: {s['ms']:.0f} ms"
                                                  for s in samples))
    return samples
