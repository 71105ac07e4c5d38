"""A worker's metrics under vLLM's names, types and units (counters end in `_total`, times are seconds, labels
`model_name` and `engine`), for what means the same as vLLM's, so that a dashboard made for vLLM reads a kvturn
worker unchanged. docs/observability.md maps each one; kvturn's own `kvturn_*` metrics stay beside them."""
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvturn.engine.llm_engine import LLMEngine
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.connector import ConnectorStats, KVConnector

LABELS = ("model_name", "engine")
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                 960.0, 1920.0, 7680.0)  # vLLM's


def request_histograms(registry, model_name: str) -> tuple:
    """(time to first token, end to end) histograms of finished requests, vLLM's, with their labels set."""
    labels = (model_name, "0")
    ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
                     buckets=TTFT_BUCKETS_S, registry=registry)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
                    buckets=E2E_BUCKETS_S, registry=registry)
    return ttft.labels(*labels), e2e.labels(*labels)


class VLLMCollector:
    """Read at scrape time from the engine's and the connector's own counters."""

    def __init__(self, engine: LLMEngine, connector: KVConnector | None, model_name: str):
        self.engine, self.connector, self.labels = engine, connector, [model_name, "0"]

    def family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        engine, stats = self.engine, self.engine.stats
        kv = self.connector.stats if self.connector else ConnectorStats()
        leases = self.connector.leases if self.connector else None
        bm, scheduler = engine.block_manager, engine.scheduler
        computed = stats.prompt_tokens - stats.prompt_tokens_cached - stats.prompt_tokens_remote
        for kind, name, doc, value in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
             len(scheduler.running)),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             len(scheduler.waiting) + len(scheduler.loading)),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks),
            (CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            (CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
             stats.generation_tokens),
            (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             scheduler.num_preemptions),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
             "tokens.", stats.prompt_tokens),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prompt_tokens_cached),
            (CounterMetricFamily, "vllm:external_prefix_cache_queries", "External prefix cache queries from KV "
             "connector cross-instance cache sharing, in terms of number of queried tokens.",
             stats.prompt_tokens - stats.prompt_tokens_cached),
            (CounterMetricFamily, "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
             "cross-instance cache sharing, in terms of number of cached tokens.", stats.prompt_tokens_remote),
            (CounterMetricFamily, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             stats.prompt_tokens_cached + stats.prompt_tokens_remote),
            (CounterMetricFamily, "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
             kv.reuse_declines.get(policy.READ_FAILED, 0)),
            (CounterMetricFamily, "vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire "
             "(leases and pins that ended unread, and reads declined as expired).",
             (leases.counts["expired"] if leases else 0) + kv.reuse_declines.get(policy.EXPIRED, 0)),
        ):
            yield self.family(kind, name, doc, value)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                        labels=[*LABELS, "source"])
        for source, value in (("local_compute", computed), ("local_cache_hit", stats.prompt_tokens_cached),
                              ("external_kv_transfer", stats.prompt_tokens_remote)):
            by_source.add_metric([*self.labels, source], value)
        yield by_source
        for name, doc, buckets in (
                ("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                 kv.read_seconds),
                ("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                 kv.read_bytes)):
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, buckets.buckets(), buckets.sum)
            yield family
