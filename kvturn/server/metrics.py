"""Prometheus metrics of one worker: engine counters read at scrape time, TTFT observed per request."""
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.prefix_host import PrefixHostStats
from kvturn.kv_transfer.connector import ConnectorStats, KVConnector
from kvturn.kv_transfer.params import HOST, POOL, TIERS
from kvturn.kv_transfer.policy import DECLINE_REASONS
from kvturn.kv_transfer.retention import REASONS
from kvturn.server.vllm_metrics import VLLMCollector, request_histograms

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    def __init__(self, engine: LLMEngine, connector: KVConnector | None):
        self.engine = engine
        self.connector = connector

    def collect(self):
        engine, stats = self.engine, self.engine.stats
        kv_stats = self.connector.stats if self.connector else ConnectorStats()
        counters = {
            "kvturn_requests_finished": ("Requests finished", stats.requests_finished),
            "kvturn_prompt_tokens": ("Prompt tokens of finished requests", stats.prompt_tokens),
            "kvturn_prompt_tokens_computed": ("Prompt tokens computed by this worker", stats.prompt_tokens_computed),
            "kvturn_prompt_tokens_cached": ("Prompt tokens served from the local prefix cache",
                                            stats.prompt_tokens_cached),
            "kvturn_prompt_tokens_remote": ("Prompt tokens read from a peer's KV over NIXL", stats.prompt_tokens_remote),
            "kvturn_generation_tokens": ("Tokens generated", stats.generation_tokens),
            "kvturn_kv_read_bytes": ("Bytes of KV read from peers", kv_stats.kv_read_bytes),
            "kvturn_kv_read_seconds": ("Seconds spent reading KV from peers", kv_stats.kv_read_seconds),
            "kvturn_kv_read_step_seconds": ("Of the seconds reading KV, this worker's steps that ran before a read "
                                            "was seen done", kv_stats.kv_read_step_seconds),
            "kvturn_kv_reads": ("KV reads from peers completed", kv_stats.kv_reads),
            "kvturn_preemptions": ("Sequences preempted for lack of KV blocks", engine.scheduler.num_preemptions),
            "kvturn_kv_host_restores": ("Turns whose history this worker copied back from its own host tier",
                                        kv_stats.host_restores),
            "kvturn_kv_host_restore_bytes": ("Bytes copied back from this worker's host tier",
                                             kv_stats.host_restore_bytes),
            "kvturn_kv_host_restore_seconds": ("Seconds copying back from this worker's host tier",
                                               kv_stats.host_restore_seconds),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        declines = CounterMetricFamily("kvturn_kv_reuse_declines", "Remote KV reuse declined, by reason",
                                       labels=["reason"])
        for reason in DECLINE_REASONS:
            declines.add_metric([reason], kv_stats.reuse_declines.get(reason, 0))
        yield declines
        yield from self.tiers(kv_stats)
        yield from self.prefix_tiers(kv_stats)
        leases = self.connector.leases if self.connector else None
        nixl = self.connector.nixl if self.connector else None
        lease_events = CounterMetricFamily("kvturn_kv_leases", "Retention leases by what ended them",
                                           labels=["event"])
        for event, value in (leases.counts.items() if leases else ()):
            lease_events.add_metric([event], value)
        yield lease_events
        choices = CounterMetricFamily("kvturn_kv_retention_choices", "Leases given up for room, by why retention "
                                      "chose them (kv_transfer/retention.py)", labels=["reason"])
        for reason in REASONS:
            choices.add_metric([reason], leases.choices[reason] if leases else 0)
        yield choices
        bm = engine.block_manager
        block_bytes = engine.kv_cache.layout.block_bytes
        cached_free = bm.num_cached_free_blocks
        retained = leases.retained_blocks if leases else 0
        gauges = {
            "kvturn_kv_blocks_total": ("KV blocks in the pool", bm.num_blocks),
            "kvturn_kv_blocks_used": ("KV blocks referenced by requests or leases", bm.num_blocks - bm.num_free_blocks),
            "kvturn_kv_blocks_free": ("KV blocks free (including cached)", bm.num_free_blocks),
            "kvturn_kv_blocks_cached": ("Free KV blocks still holding a reusable prefix", cached_free),
            "kvturn_kv_leases_active": ("Retention leases alive", leases.active if leases else 0),
            "kvturn_kv_retained_blocks": ("KV blocks held by retention leases", retained),
            "kvturn_kv_retained_bytes": ("KV bytes held by retention leases", retained * block_bytes),
            "kvturn_requests_running": ("Requests running", len(engine.scheduler.running)),
            "kvturn_requests_waiting": ("Requests waiting", len(engine.scheduler.waiting)),
            "kvturn_requests_loading_kv": ("Requests waiting for a remote KV read", len(engine.scheduler.loading)),
            "kvturn_nixl_peers": ("Peers this worker has a NIXL connection to", len(nixl.peers) if nixl else 0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)


    def tiers(self, kv_stats: ConnectorStats):
        """Retention per tier: bytes held, moves between tiers, reads of each tier (by this worker from peers, and of
        this worker's leases as it saw them)."""
        block_bytes = self.engine.kv_cache.layout.block_bytes
        leases = self.connector.leases if self.connector else None
        host = self.connector.host if self.connector else None
        by_tier = {
            ("kvturn_kv_tier_retained_bytes", GaugeMetricFamily, "KV bytes held by retention leases, by tier"):
                {tier: (leases.blocks_in(tier) * block_bytes if leases else 0) for tier in TIERS},
            ("kvturn_kv_tier_capacity_bytes", GaugeMetricFamily, "Bytes of each tier (the pool's for all uses)"):
                {POOL: self.engine.kv_cache.nbytes, HOST: host.cache.nbytes if host else 0},
            ("kvturn_kv_tier_lease_reads", CounterMetricFamily, "Reads of this worker's leases it saw (a peer's "
             "lease acquire, its own copy back from the host tier), by tier"):
                {tier: (leases.reads[tier] if leases else 0) for tier in TIERS},
            ("kvturn_kv_tier_reads", CounterMetricFamily, "KV reads from peers completed, by the tier they read"):
                {tier: kv_stats.reads_by_tier[tier] for tier in TIERS},
            ("kvturn_kv_tier_read_bytes", CounterMetricFamily, "Bytes of KV read from peers, by tier"):
                {tier: kv_stats.read_bytes_by_tier[tier] for tier in TIERS},
            ("kvturn_kv_tier_read_seconds", CounterMetricFamily, "Seconds reading KV from peers, by tier"):
                {tier: kv_stats.read_seconds_by_tier[tier] for tier in TIERS},
        }
        for (name, kind, doc), values in by_tier.items():
            family = kind(name, doc, labels=["tier"])
            for tier, value in values.items():
                family.add_metric([tier], value)
            yield family
        moves = CounterMetricFamily("kvturn_kv_tier_moves", "Leases moved between tiers (pool to host under pressure; "
                                    "host to pool: copied back for this worker's own use)", labels=["from", "to"])
        for (source, target) in ((POOL, HOST), (HOST, POOL)):
            moves.add_metric([source, target], leases.moves[(source, target)] if leases else 0)
        yield moves


    def prefix_tiers(self, kv_stats: ConnectorStats):
        """The prefix cache per tier: tokens of prompts served from the pool and from the host tier, blocks moved
        between them, bytes the host tier holds, restores its checks refused."""
        engine, stats = self.engine, self.engine.stats
        layout = engine.kv_cache.layout
        lease_restored = kv_stats.host_restore_bytes // layout.block_bytes * layout.block_size  # D's own leases
        region = engine.prefix_host
        host_stats = region.stats if region else PrefixHostStats()
        hits = CounterMetricFamily("kvturn_prefix_cache_hit_tokens", "Prompt tokens served by this worker's prefix "
                                   "cache, by the tier that held them", labels=["tier"])
        hits.add_metric([POOL], stats.prompt_tokens_cached - stats.prompt_tokens_cached_host - lease_restored)
        hits.add_metric([HOST], stats.prompt_tokens_cached_host)
        yield hits
        moves = CounterMetricFamily("kvturn_prefix_cache_tier_moves", "Prefix-cache blocks moved between tiers "
                                    "(pool to host on eviction, host to pool on a hit)", labels=["from", "to"])
        moves.add_metric([POOL, HOST], host_stats.blocks_stored)
        moves.add_metric([HOST, POOL], host_stats.blocks_restored)
        yield moves
        held = GaugeMetricFamily("kvturn_prefix_cache_tier_bytes", "KV bytes the prefix cache's host tier holds",
                                 labels=["tier"])
        held.add_metric([HOST], region.bytes_held if region else 0)
        yield held
        yield GaugeMetricFamily("kvturn_prefix_cache_host_capacity_bytes", "Bytes of the prefix cache's host tier",
                                value=region.cache.nbytes if region else 0)
        yield CounterMetricFamily("kvturn_prefix_cache_host_dropped_blocks", "Blocks the prefix cache's host tier "
                                  "let go to make room (least recently used)", value=host_stats.blocks_dropped)
        refused = CounterMetricFamily("kvturn_prefix_cache_host_restore_failures", "Host-tier hits not restored "
                                      "(the slot was recycled or held another hash): computed", labels=["reason"])
        for reason, value in host_stats.restore_failures.items():
            refused.add_metric([reason], value)
        yield refused


class Observed:
    """Histograms that observe the same value: kvturn's and vLLM's of one quantity."""

    def __init__(self, *histograms):
        self.histograms = histograms

    def observe(self, value: float) -> None:
        for histogram in self.histograms:
            histogram.observe(value)


class WorkerMetrics:
    def __init__(self, engine: LLMEngine, connector: KVConnector | None, model_name: str = ""):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, connector))
        self.registry.register(VLLMCollector(engine, connector, model_name))
        self.side_channel_refusals = Counter("kvturn_side_channel_refused", "Side-channel calls refused for a "
                                             "wrong or missing cluster secret", registry=self.registry)
        vllm_ttft, vllm_e2e = request_histograms(self.registry, model_name)
        self.ttft = Observed(Histogram("kvturn_time_to_first_token_seconds", "Time from arrival to first token",
                                       buckets=TTFT_BUCKETS_S, registry=self.registry), vllm_ttft)
        self.e2e = Observed(Histogram("kvturn_request_latency_seconds", "Time from arrival to last token",
                                      buckets=TTFT_BUCKETS_S, registry=self.registry), vllm_e2e)
        self.streams_not_read = Counter("kvturn_streams_not_read", "Streamed requests ended because their client "
                                        "took no output for unread_stream_timeout_s", registry=self.registry)
