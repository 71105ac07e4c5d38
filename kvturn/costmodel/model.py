"""The cost model: what each part of a turn costs, learned online from what every response reports (compute time
against tokens computed and context, NIXL bytes against time, the time nobody's compute or transfer explains, how
much of a lease the next prompt shares). The router learns it from its turns; the planner sets it from a
calibration and runs the same code on a simulated clock."""
from collections import deque

from kvturn.costmodel.fits import (CALIBRATION_WORKERS, MAX_CALIBRATION_STEPS, MIN_SAMPLES, PRIOR, ComputeFit, Mean,
                                   Typical, calibration_step)
from kvturn.costmodel.reports import own_read_ms, shared_steps
from kvturn.costmodel.tokens import TokenEstimator

RECOMPUTE, PULL, COMPUTE_ON_DECODE = "recompute", "pull", "compute_on_decode"
PATHS = (RECOMPUTE, PULL, COMPUTE_ON_DECODE)


class CostModel:
    def __init__(self):
        # Priors: a small model on a CPU core; replaced by measurements after a few turns.
        self.prefill = {"prefill": ComputeFit(PRIOR), "decode": ComputeFit(PRIOR)}
        self.calibrations = {role: 0 for role in self.prefill}  # workers whose start-up timings were learned
        # NIXL reads per direction: P's read of the history from D, and D's read of the new blocks from P, which
        # waits for D's engine step under way and so costs far more per MiB than P's.
        self.read_ms_per_mib = Typical(0.5)  # D->P
        self.handoff_read_ms_per_mib = Typical(0.5)  # P->D; until one is measured, D->P's speed stands in
        # D->P from D's host tier (P's report names the tier it read); until one is measured, the pool's speed
        # stands in. And D's own copy back from its host tier before it computes on decode.
        self.host_read_ms_per_mib = Typical(0.5)
        self.host_restore_ms_per_mib = Typical(0.25)
        self.bytes_per_token = Mean(4096.0)
        # P computes each layer of the new tokens as that layer of the history arrives (0: it reads, then computes)
        self.read_overlap_layers = 0
        self.other_ms = {path: Typical(15.0 if path != COMPUTE_ON_DECODE else 5.0) for path in PATHS}
        self.tokens = TokenEstimator()
        # Tokens at the end of the lease that the next prompt does not share (its last blocks: the answer's last
        # tokens, written into the prompt, tokenize otherwise): those are computed again, whatever the path.
        self.unshared_tail_tokens = Typical(0.0)
        self.prefill_request_ms = Typical(100.0)  # a prefill worker's round trip: what each queued request adds
        # Measured / modelled compute and transfer of each path's recent turns: what the fits, smooth over all
        # shapes of turn, miss for this path's own (contention on shared cores, for one).
        self.correction = {path: Typical(1.0, deque(maxlen=16)) for path in PATHS}
        self.turns_since_chosen = {path: 0 for path in PATHS}  # adaptive explores what it has not measured lately

    @classmethod
    def calibrated(cls, compute_fits: dict, read_ms_per_mib: dict, bytes_per_token: float,
                   other_ms: dict) -> "CostModel":
        """The model as it stands once measured: each compute fit (per role, (a, b, c, q)) through points of its
        own, each read rate ("d_to_p", "p_to_d") and the KV bytes per token as MIN_SAMPLES samples, and each path's
        time outside compute and transfer (the planner runs the router's code from a calibration so)."""
        model = cls()
        for role, terms in compute_fits.items():
            fit = model.prefill[role] = ComputeFit(terms)
            for new, context in ((512, 0), (2048, 0), (4096, 0), (256, 4096), (128, 8192)):
                fit.add(new, context, max(fit.predict(new, context), 1e-3))
        for measured, value in ((model.read_ms_per_mib, read_ms_per_mib["d_to_p"]),
                                (model.handoff_read_ms_per_mib, read_ms_per_mib["p_to_d"]),
                                (model.bytes_per_token, bytes_per_token)):
            for _ in range(MIN_SAMPLES):
                measured.add(value)
        model.other_ms.update({path: Typical(ms) for path, ms in other_ms.items()})
        return model

    def observe_turn(self, choice, actual_ms: float, explained_ms: float, shared: bool = False) -> None:
        """Learn from a finished turn's time to first token, of which `explained_ms` was compute and transfer
        (as the workers measured them): the time outside them and the queue (the model's own estimate of it, so
        that what the queue model misses shows there), and how far the measured compute and transfer were from
        their model. Each term learns its own part only, so that one error is not learned twice. A turn whose
        prefill was batched with other prompts (`shared`) teaches neither: its time is the batch's."""
        estimate = choice.estimate
        if actual_ms <= 0 or shared:
            return
        self.other_ms[choice.path].add(max(actual_ms - explained_ms - estimate.queue_ms, 0.0))
        if estimate.explained_ms > 0 and explained_ms > 0:
            ratio = explained_ms / estimate.explained_ms
            self.correction[choice.path].add(min(max(ratio, 0.25), 4.0))

    def chosen(self, path: str) -> None:
        for other in self.turns_since_chosen:
            self.turns_since_chosen[other] = 0 if other == path else self.turns_since_chosen[other] + 1

    def compute_ms(self, role: str, new_tokens: int, context: int) -> float:
        fit = self.prefill[role]
        if role == "decode" and not fit.calibrated:
            fit = self.prefill["prefill"]  # the same model on the same kind of machine, until D has its own
        return fit.predict(new_tokens, context)

    def observe_reuse(self, leased_tokens: int, reused_tokens: int) -> None:
        """Learn from a turn how much of its lease (`leased_tokens`) the new prompt really shared."""
        if leased_tokens and 0 <= leased_tokens - reused_tokens < leased_tokens:
            self.unshared_tail_tokens.add(leased_tokens - reused_tokens)

    def reusable_tokens(self, leased_tokens: int) -> int:
        return max(leased_tokens - round(self.unshared_tail_tokens.value), 0) if leased_tokens else 0

    def read_ms(self, tokens: int, direction: str = "d_to_p", tier: str = "pool") -> float:
        per_mib = self.read_ms_per_mib.value
        if direction == "p_to_d" and self.handoff_read_ms_per_mib.values:
            per_mib = self.handoff_read_ms_per_mib.value
        elif tier == "host" and self.host_read_ms_per_mib.values:
            per_mib = self.host_read_ms_per_mib.value
        return tokens * self.bytes_per_token.value / 2**20 * per_mib

    def observe_read_overlap(self, layers) -> None:
        """A prefill worker's /kv/calibration says whether it overlaps its reads with compute, over how many layers."""
        if type(layers) is int and 0 <= layers <= 4096:
            self.read_overlap_layers = layers

    def pull_ms(self, read_ms: float, compute_ms: float) -> float:
        """A pull's read then compute; read layer by layer beside the compute, the longer of the two plus one layer's
        share of the shorter (the first layer's read before any compute, or the last layer's compute after it)."""
        layers = self.read_overlap_layers
        if not layers:
            return read_ms + compute_ms
        return max(read_ms, compute_ms) + min(read_ms, compute_ms) / layers

    def restore_ms(self, tokens: int) -> float:
        """D copying `tokens` of history back from its host tier into its pool (compute on decode)."""
        return tokens * self.bytes_per_token.value / 2**20 * self.host_restore_ms_per_mib.value

    def observe_calibration(self, role: str, steps) -> int:
        """Learn the prefill steps a `role` worker timed at start-up (its /kv/calibration); returns how many were
        taken. Only the first CALIBRATION_WORKERS workers of a role teach it (a hundred idle workers must not
        outweigh what requests measure), and their replies are checked like any peer's (calibration_step)."""
        if role not in self.prefill or self.calibrations[role] >= CALIBRATION_WORKERS:
            return 0
        taken = [step for step in map(calibration_step, steps if isinstance(steps, list) else []) if step]
        taken = taken[:MAX_CALIBRATION_STEPS]
        if not taken:
            return 0
        self.calibrations[role] += 1
        fit = self.prefill[role]
        if not fit.measured:  # the role's first worker sets the prior; the next only adds samples
            fit.adopt_prior(taken)
        for n, context, ms in taken:
            fit.add(n, context, ms, calibration=True)
        return len(taken)

    def observe_prefill(self, role: str, report: dict) -> None:
        """Learn from a worker's `kvturn` report of one request."""
        computed = report.get("prompt_tokens_computed") or 0
        context = (report.get("prompt_tokens_cached") or 0) + (report.get("prompt_tokens_remote") or 0)
        timing = report.get("timing") or {}
        if not shared_steps(report):
            self.prefill[role].add(computed, context, timing.get("prefill_compute_ms") or 0.0)
        read_bytes, read_ms = report.get("kv_read_bytes") or 0, own_read_ms(role, timing)
        if role == "prefill":  # a read's speed is its whole time, the part its own step's compute hid included
            read_ms += timing.get("kv_read_hidden_ms") or 0.0
        # A read that P's steps overlapped teaches no speed: over shared memory what is left of it is its own cost,
        # but over a NIC the transfer runs beside the steps, and what is left would say it cost nothing.
        overlapped = role == "prefill" and (timing.get("kv_read_step_ms") or 0.0) > 0
        if read_bytes >= 2**18 and read_ms > 0 and not overlapped:
            speed = self.handoff_read_ms_per_mib
            if role == "prefill":
                speed = self.host_read_ms_per_mib if report.get("kv_tier") == "host" else self.read_ms_per_mib
            speed.add(read_ms / (read_bytes / 2**20))
        restore_bytes, restore_ms = report.get("host_restore_bytes") or 0, timing.get("host_restore_ms") or 0.0
        if restore_bytes >= 2**18 and restore_ms > 0:
            self.host_restore_ms_per_mib.add(restore_ms / (restore_bytes / 2**20))
        remote = report.get("prompt_tokens_remote") or 0
        if remote and read_bytes:
            self.bytes_per_token.add(read_bytes / remote)
