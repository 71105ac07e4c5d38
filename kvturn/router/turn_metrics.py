"""What the router measures of each finished turn as its client saw it: time to first token (a streamed turn's first
token leaving the router), the whole turn, and the KV bytes moved each way (D->P: the history read back; P->D: the
new prompt's blocks), summed from the workers' reports. The engines' own figures are theirs, under vLLM's names
(server/vllm_metrics.py)."""
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvturn.server.vllm_metrics import E2E_BUCKETS_S, TTFT_BUCKETS_S

DIRECTIONS = ("d_to_p", "p_to_d")


class TurnMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.ttft = Histogram("kvturn_router_time_to_first_token_seconds", "Time from a streamed turn's arrival at "
                              "the router to its first token sent to the client", buckets=TTFT_BUCKETS_S,
                              registry=registry)
        self.e2e = Histogram("kvturn_router_e2e_request_latency_seconds", "Time from a turn's arrival at the router "
                             "to its last token", buckets=E2E_BUCKETS_S, registry=registry)
        self.kv_bytes = Counter("kvturn_router_kv_transferred_bytes", "KV bytes moved between workers for the "
                                "router's turns, by direction (d_to_p: history read back by prefill; p_to_d: the "
                                "prompt read by decode)", ["direction"], registry=registry)
        for direction in DIRECTIONS:
            self.kv_bytes.labels(direction)

    def observe(self, turn, report: dict) -> None:
        now = time.perf_counter()
        self.e2e.observe(now - turn.started)
        if turn.first_token_at is not None:
            self.ttft.observe(turn.first_token_at - turn.started)
        for direction, key in zip(DIRECTIONS, ("bytes_d_to_p", "bytes_p_to_d")):
            moved = report.get(key)
            if isinstance(moved, int) and moved > 0:
                self.kv_bytes.labels(direction).inc(moved)
