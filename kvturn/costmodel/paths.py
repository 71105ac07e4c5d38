"""Which path a turn takes: recompute on P, pull the history D->P then compute the new tokens on P, or compute the
new tokens on D, which already holds the history. `predict` prices each path from the cost model; `choose` is pure."""
from dataclasses import dataclass

from kvturn.costmodel.model import COMPUTE_ON_DECODE, PULL, RECOMPUTE, CostModel

POLICIES = ("adaptive", "pull", "recompute", "compute_on_decode")
EXPLORE_EVERY = 16  # adaptive: a path not taken for this many turns is taken once, to re-measure it...
EXPLORE_WITHIN = 1.5  # ...if its predicted cost is at most this many times the best path's


@dataclass(frozen=True, slots=True)
class TurnView:
    """What the router knows of a turn before it starts."""
    prompt_tokens: int  # estimated from the body
    retained_tokens: int  # whose KV the decode worker holds for this conversation (0: no live lease)
    decode_running: int  # requests the holding decode worker is already serving
    decode_available: bool  # the holding decode worker is healthy and has room for one more
    prefill_in_flight: int  # requests queued or running on the least-loaded prefill worker
    # Predicted work still queued ahead of this turn, ms (see workers.WorkerState.backlog_ms); without it the
    # prefill queue is taken as `prefill_in_flight` typical round trips.
    prefill_backlog_ms: float | None = None
    decode_backlog_ms: float = 0.0  # prefills sent to the holding decode worker that have not yet produced
    first_token_ahead: bool = False  # the router streams P's first token itself: D's part is not in the TTFT
    decode_step_ms: float = 0.0  # one engine step of the holding decode worker now (its running decodes share it)
    retained_tier: str = "pool"  # where the decode worker likely holds the lease: its pool, or its host tier
    prefill_cached_tokens: int = 0  # of the prompt, what the chosen prefill worker's prefix cache likely holds


@dataclass(frozen=True, slots=True)
class Estimate:
    queue_ms: float  # work queued ahead of the turn on its worker
    explained_ms: float  # the turn's compute and transfer in its time to first token, as modelled
    other_ms: float  # the rest of its time to first token once its worker takes it up: hops, bookkeeping
    stall_ms: float  # what the path makes the decode worker's running requests wait, summed
    work_ms: float  # the compute and transfer this turn adds to its worker's queue
    tokens_computed: int = 0  # the prompt tokens the path computes, as estimated

    def predicted_ms(self, correction: float) -> float:
        return self.queue_ms + self.explained_ms * correction + self.other_ms


@dataclass(frozen=True, slots=True)
class PathChoice:
    path: str
    predicted_ms: dict  # every path's predicted time to first token
    stall_ms: float  # what the chosen path makes the decode worker's running requests wait, summed
    estimate: Estimate  # the chosen path's, before the correction learned from measurements

    @property
    def work_ms(self) -> float:
        """The chosen path's own work on its worker (what later turns queue behind)."""
        return self.estimate.work_ms


def predict(model: CostModel, turn: TurnView) -> dict[str, Estimate]:
    """Each possible path's time to first token, the stall it inflicts on running decodes, and its work."""
    retained = model.reusable_tokens(turn.retained_tokens)
    new = max(turn.prompt_tokens - retained, 1)
    queue = turn.prefill_backlog_ms
    if queue is None:
        queue = turn.prefill_in_flight * model.prefill_request_ms.value
    handoff = 0.0 if turn.first_token_ahead else model.read_ms(new, "p_to_d")  # D reads the new blocks before its token
    cached = min(max(turn.prefill_cached_tokens, 0), turn.prompt_tokens - 1)  # P computes the rest itself
    full = model.compute_ms("prefill", turn.prompt_tokens - cached, cached)
    out = {RECOMPUTE: Estimate(queue, full + handoff, model.other_ms[RECOMPUTE].value, 0.0, full,
                               turn.prompt_tokens - cached)}
    if turn.retained_tokens > 0:
        read = model.read_ms(max(retained - cached, 0), tier=turn.retained_tier)  # P reads what it lacks
        pull = model.pull_ms(read, model.compute_ms("prefill", new, retained))
        out[PULL] = Estimate(queue, pull + handoff, model.other_ms[PULL].value, 0.0, pull, new)
    if turn.retained_tokens > 0 and turn.decode_available:
        # D's measured compute of a prompt includes the decodes it shares its step with; before that step the
        # turn waits for the one under way, half a step on average.
        on_decode = model.compute_ms("decode", new, retained)
        if turn.retained_tier == "host":
            on_decode += model.restore_ms(retained)  # D first copies the history back into its pool
        step_wait = turn.decode_step_ms / 2 if turn.decode_running else 0.0
        out[COMPUTE_ON_DECODE] = Estimate(turn.decode_backlog_ms + step_wait, on_decode,
                                          model.other_ms[COMPUTE_ON_DECODE].value, on_decode * turn.decode_running,
                                          on_decode, new)
    return out


def choose(model: CostModel, turn: TurnView, policy: str, stall_weight: float) -> PathChoice:
    """The path of least predicted time to first token plus `stall_weight` times the wait it puts on others;
    a fixed policy takes its own path whenever it is possible. Adaptive also takes, once in a while, a path it
    has not taken lately when that path is predicted not far off, so its measurements of it stay current."""
    modelled = predict(model, turn)
    predicted = {path: e.predicted_ms(model.correction[path].value) for path, e in modelled.items()}
    cost = {path: predicted[path] + stall_weight * e.stall_ms for path, e in modelled.items()}
    if policy in cost:
        path = policy
    elif policy == "adaptive":
        path = min(cost, key=cost.get)
        stale = [p for p in cost if model.turns_since_chosen[p] >= EXPLORE_EVERY
                 and cost[p] <= EXPLORE_WITHIN * cost[path]]
        if stale:
            path = max(stale, key=model.turns_since_chosen.get)
    else:
        path = PULL if PULL in cost else RECOMPUTE
    return PathChoice(path, predicted, modelled[path].stall_ms, modelled[path])
