"""Every tunable setting, one dataclass per component: each default written once, with its unit in its name,
validated once at start-up. The command line takes its defaults and help from here (see `cli.option`)."""
from dataclasses import MISSING, dataclass, field, fields

ROLES = ("prefill", "decode", "both")
BACKENDS = ("kvturn", "vllm", "auto")
PATH_POLICIES = ("pull", "adaptive", "recompute", "compute_on_decode")
PREFILL_CHOICES = ("least-loaded", "prefix-affine")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# Seconds kvturn's servers (workers, router) keep an idle HTTP connection open: longer than their clients keep one
# (the router's 4 s, aiohttp's 15 s, a proxy's 60 s), so that the client ends it. A server that closes first races
# a client sending on the connection at that moment, and the request fails with a disconnect (uvicorn's default
# is 5 s).
SERVER_KEEP_ALIVE_S = 75
# A stack's random name, given to each of its processes by its launcher (kvturn/launch.py): /health answers it (the
# X-Kvturn-Instance header), so that the launcher knows its own process from another stack's on the same port.
INSTANCE_ENV, INSTANCE_HEADER = "KVTURN_INSTANCE", "X-Kvturn-Instance"
LOG_FILE_ENV = "KVTURN_LOG_FILE"  # the file a process's output goes to, set by its launcher (kvturn/launch.py)


def is_redis_url(value: str | None) -> bool:
    return bool(value) and value.startswith(REDIS_SCHEMES)


class ConfigError(ValueError):
    pass


def setting(default, help: str):
    """A field with its --help text; mutable defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def default_of(cls, name: str):
    spec = next(f for f in fields(cls) if f.name == name)
    return spec.default_factory() if spec.default is MISSING else spec.default


def help_of(cls, name: str) -> str:
    return next(f for f in fields(cls) if f.name == name).metadata.get("help", "")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        _check(value is None or value > 0, f"{name} must be positive, got {value}")


@dataclass(slots=True)
class EngineConfig:
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_mb: int = setting(512, "size of the KV pool, MiB")
    num_kv_blocks: int | None = setting(None, "blocks in the KV pool (overrides --kv-cache-mb)")
    max_num_seqs: int = setting(32, "most requests running at once")
    max_num_batched_tokens: int = setting(8192, "token budget of one step (chunked prefill)")
    prefill_pack_tokens: int = setting(512, "prompt tokens that prompts sharing a step may compute (one prompt "
                                            "alone may take the whole budget; past this, packing only delays "
                                            "the first on a CPU)")
    max_model_len: int | None = setting(None, "longest prompt + completion (default: the model's)")
    enable_prefix_caching: bool = setting(True, "reuse KV of earlier requests with the same prefix")
    prefix_host_mb: int = setting(0, "host tier of the prefix cache, MiB: full blocks the pool evicts are kept there "
                                     "and copied back on a later prefix hit (0: off)")
    dtype: str = setting("float32", "KV and compute dtype (float32 is fastest on CPUs)")
    step_history_steps: int = setting(20_000, "forward steps kept for /kv/steps (kvturn plan's calibration; "
                                              "~150 bytes each)")

    def __post_init__(self):
        _positive(self, "block_size", "kv_cache_mb", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                  "prefill_pack_tokens", "max_model_len", "step_history_steps")
        _check(self.prefix_host_mb >= 0, f"prefix_host_mb must be 0 or more, got {self.prefix_host_mb}")
        _check(not self.prefix_host_mb or self.enable_prefix_caching,
               "prefix_host_mb needs prefix caching on: the host tier holds what the prefix cache evicts")
        _check(self.dtype in ("float32", "bfloat16", "float16"), f"dtype must be float32, bfloat16 or float16, "
                                                                  f"got {self.dtype!r}")


@dataclass(slots=True)
class ConnectorConfig:
    """The KV connector: when to read a peer's blocks, how long blocks are kept for a peer, whom to trust."""
    kv_recompute_threshold_tokens: int = setting(64, "read remote KV only if it saves at least this many tokens")
    kv_read_timeout_s: float = setting(5.0, "give up on a remote KV read after this long, s")
    kv_expiry_margin_s: float = setting(5.0, "decline a remote read whose lease ends within this, s")
    decoder_kv_blocks_ttl_s: float = setting(480.0, "how long decode retains a finished turn's KV, s")
    kv_pin_timeout_s: float = setting(30.0, "how long prefill pins a prompt's KV for decode to read, s")
    retained_kv_budget_mb: int | None = setting(None, "most KV retained under leases in the engine pool, MiB (past it, "
                                                       "the least recently used lease moves to the host tier, or is "
                                                       "dropped without one)")
    retained_host_mb: int | None = setting(None, "host tier of retained KV, MiB: leases the pool has no room for move "
                                                 "here instead of being dropped, and are read from here (pinned host "
                                                 "memory on a GPU build, DRAM here); registered with NIXL")
    kv_lease_max_age_s: float = setting(3600.0, "a lease is renewed (to its TTL again) each time its conversation "
                                                "reads it, but never past this age, s")
    side_channel_timeout_s: float = setting(5.0, "give up on a peer's side channel after this long, s")
    kv_read_overlap: bool = setting(True, "prefill reads a history layer by layer and computes each layer of the new "
                                          "tokens as soon as that layer has arrived (off: the whole read, then the "
                                          "compute)")
    kv_read_layer_wait_s: float = setting(1.0, "longest a prefill step waits for one layer of a history read beside "
                                               "it (the whole step waits), s; past it the read is given up and the "
                                               "prompt recomputed")
    cluster_secret: str | None = setting(None, "shared secret of the cluster: peers and the router present it")
    trusted_peers: list[str] = setting([], "HOST:PORT of a peer whose side channel may be contacted for any caller")

    def __post_init__(self):
        _check(self.kv_recompute_threshold_tokens >= 0, "kv_recompute_threshold_tokens must be >= 0")
        _positive(self, "kv_read_timeout_s", "decoder_kv_blocks_ttl_s", "kv_pin_timeout_s", "retained_kv_budget_mb",
                  "retained_host_mb", "kv_lease_max_age_s", "side_channel_timeout_s", "kv_read_layer_wait_s")
        _check(self.kv_expiry_margin_s >= 0, "kv_expiry_margin_s must be >= 0")
        _check(self.kv_expiry_margin_s < self.decoder_kv_blocks_ttl_s,
               "kv_expiry_margin_s must be below decoder_kv_blocks_ttl_s, or no retained block is ever read")
        _check(self.cluster_secret is None or len(self.cluster_secret) >= 16,
               "cluster_secret must be at least 16 characters")
        for peer in self.trusted_peers:
            host, _, port = peer.rpartition(":")
            _check(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                   f"trusted peer {peer!r} must be HOST:PORT")


@dataclass(slots=True)
class WorkerConfig:
    model_dir: str
    role: str = setting("both", "prefill, decode or both (colocated)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8100, "HTTP port (OpenAI API and KV side channel)")
    advertise_host: str | None = setting(None, "address peers use to reach this worker (default: --host)")
    served_model_name: str | None = setting(None, "model name in the API (default: the directory name)")
    bidirectional: bool = setting(False, "decode retains finished KV for the next turn's prefill to read back")
    max_logprobs: int = setting(20, "most top_logprobs a request may ask for")
    default_max_output_tokens: int = setting(8192, "an answer's length when its request gives no max_tokens, tokens "
                                                   "(less where the context ends first)")
    unread_stream_timeout_s: float = setting(60.0, "end a streamed answer whose client has left its oldest unsent "
                                                   "output untaken this long (it stopped reading), s")
    max_body_mb: int = setting(64, "largest request body accepted, MiB (above the router's --max-body-mb: the "
                                   "router adds a lease record to what it forwards)")
    register_url: str | None = setting(None, "redis://HOST:PORT/DB where this worker announces itself to routers "
                                             "started with --discover (as http://ADVERTISE_HOST:PORT)")
    register_ttl_s: float = setting(10.0, "a registration not renewed for this long expires (renewed three times "
                                          "as often), s")
    otlp_traces_endpoint: str | None = setting(None, "OTLP/HTTP URL to send traces to, e.g. http://collector:4318/v1/traces (default: the "
                                                       "standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                                                       "OTEL_EXPORTER_OTLP_ENDPOINT; neither: no traces)")
    calibrate: bool = setting(True, "time a few prefill steps at start-up (~1 s on a CPU core with the embedded "
                                    "model) and serve them at /kv/calibration: routers predict the first turns "
                                    "from this machine's speed")
    engine: EngineConfig = field(default_factory=EngineConfig)
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)

    def __post_init__(self):
        _check(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        _check(0 < self.port < 65536, f"port must be a TCP port, got {self.port}")
        _check(self.max_logprobs >= 0, "max_logprobs must be >= 0")
        _positive(self, "default_max_output_tokens", "unread_stream_timeout_s", "max_body_mb")
        _check(self.register_url is None or is_redis_url(self.register_url),
               f"register_url must be a redis:// URL, got {self.register_url!r}")
        _positive(self, "register_ttl_s")
        _check(self.register_ttl_s <= 300, "register_ttl_s must be at most 300 s (routers believe no registration "
                                           "for longer)")

    @property
    def transfers_kv(self) -> bool:
        """Whether this worker has a KV connector: every P/D role, and a colocated one that retains."""
        return self.role != "both" or self.bidirectional


@dataclass(slots=True)
class RouterConfig:
    prefill_urls: list[str] = setting([], "prefill worker URL (repeat for several)")
    decode_urls: list[str] = setting([], "decode worker URL (repeat for several)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "HTTP port")
    conversation_ttl_s: float = setting(450.0, "how long the router remembers a conversation's lease, s "
                                               "(keep it below the decode TTL)")
    max_conversations: int = setting(100_000, "most conversations the router tracks (oldest dropped first; in Redis "
                                              "they expire by TTL instead)")
    state_path: str | None = setting(None, "SQLite file that keeps the conversation table across restarts, or a "
                                           "redis://HOST:PORT/DB URL that router replicas share")
    discover_url: str | None = setting(None, "redis://HOST:PORT/DB where workers register (kvturn worker --register); "
                                             "they join --prefill/--decode")
    max_in_flight_per_decode: int = setting(32, "a conversation's decode worker is skipped above this load")
    health_interval_s: float = setting(2.0, "how often workers are probed, s")
    upstream_timeout_s: float = setting(120.0, "give up on a worker that sends nothing for this long, s")
    no_worker_wait_s: float = setting(30.0, "a turn that finds no healthy prefill or decode worker (one restarting) "
                                            "waits this long for one to answer its health probe before it is "
                                            "answered 503, s (0: at once)")
    cluster_secret: str | None = setting(None, "shared secret the router presents to workers")
    api_keys: list[str] = setting([], "client API key (repeat for several); clients must send "
                                      "'Authorization: Bearer KEY' and see only their own conversations")
    admin_keys: list[str] = setting([], "key that /metrics and the worker list of /health require (repeat for "
                                        "several; 'Authorization: Bearer KEY'); without one, /metrics is open and "
                                        "/health lists workers only with --expose-internals")
    expose_internals: bool = setting(False, "show clients where their turns ran (worker URLs, engine ids in the "
                                            "kvturn object) and let them ask for kv_transfer_params (lease handles "
                                            "and their MACs): for a cluster's own benchmarks and tests")
    max_body_mb: int = setting(32, "largest request body accepted, MiB")
    path_policy: str = setting("pull", "how a turn with a live lease is served: pull (D->P read, then P->D), "
                                       "compute_on_decode (D computes the new tokens on its retained KV), "
                                       "recompute (P computes all), or adaptive (the cheapest by the costs "
                                       "the workers measured)")
    prefill_choice: str = setting("least-loaded", "how a turn's prefill worker is chosen: least-loaded (the least "
                                                  "predicted backlog) or prefix-affine (the conversation's own, by "
                                                  "a hash of its key, as llm-d routes by prefix, so its later turns "
                                                  "meet the prefix cache that holds its history)")
    prefill_spill_ms: float = setting(2000.0, "prefix-affine: a turn goes to the least loaded prefill worker "
                                              "instead while its own one's predicted backlog is this much above, ms")
    stall_weight: float = setting(1.0, "adaptive: how much 1 ms of waiting imposed on a decode worker's running "
                                       "requests counts against 1 ms of this turn's time to first token")
    backend: str = setting("auto", "what the workers are: kvturn, vllm (vLLM with NixlConnector, bidirectional), or "
                                   "auto (asked per worker)")
    tokenizer_dir: str | None = setting(None, "model directory whose tokenizer counts a prompt's tokens (a first "
                                              "turn's, or the messages a turn adds) to price its paths (default: "
                                              "estimated from their bytes); "
                                              "vLLM backend: with its chat template it gives the prompt's token ids "
                                              "here (default: ask prefill's /tokenize)")
    kv_recompute_threshold_tokens: int = setting(64, "vLLM backend: hand prefill a decode worker's KV only if at "
                                                     "least this many of its tokens are verified (vLLM's "
                                                     "kv_recompute_threshold)")
    vllm_retain_streamed_turns: bool = setting(True, "vLLM backend: after a streamed turn (vLLM <= 0.32 streams no "
                                                     "kv_transfer_params) ask decode to retain prompt + answer with "
                                                     "one 1-token call, so the next turn can still reuse")
    vllm_retention_lease_s: float = setting(30.0, "vLLM backend: how long decode keeps what a retention call "
                                                  "retained (its kv_lease_duration); the router forgets it "
                                                  "5 s sooner")
    otlp_traces_endpoint: str | None = setting(None, "OTLP/HTTP URL to send traces to, e.g. http://collector:4318/v1/traces (default: the "
                                                       "standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                                                       "OTEL_EXPORTER_OTLP_ENDPOINT; neither: no traces)")
    session_headers: list[str] = setting(["X-Conversation-Id", "X-Session-ID", "X-Dynamo-Session-ID",
                                          "X-SMG-Routing-Key", "X-Correlation-ID", "x-claude-code-session-id",
                                          "session-id"],
                                         "request header that names a conversation (repeat for several; the "
                                         "first one a request carries wins; the body's conversation_id beats "
                                         "them all)")
    trace_out: str | None = setting(None, "append one JSON line per finished turn to this file (arrival time, the "
                                          "scoped conversation digest, prompt and output tokens, finish time): "
                                          "the traffic record kvturn plan reads")

    def __post_init__(self):
        _check(bool(self.prefill_urls) and bool(self.decode_urls) or bool(self.discover_url),
               "give at least one prefill and one decode URL, or --discover")
        _check(self.discover_url is None or is_redis_url(self.discover_url),
               f"discover_url must be a redis:// URL, got {self.discover_url!r}")
        _positive(self, "conversation_ttl_s", "max_conversations", "max_in_flight_per_decode", "health_interval_s",
                  "upstream_timeout_s", "max_body_mb")
        _check(self.no_worker_wait_s >= 0, "no_worker_wait_s must be >= 0")
        _check(0 < self.port < 65536, f"port must be a TCP port, got {self.port}")
        _check(self.cluster_secret is None or len(self.cluster_secret) >= 16,
               "cluster_secret must be at least 16 characters")
        _check(all(self.api_keys), "an API key may not be empty")
        _check(all(self.admin_keys), "an admin key may not be empty")
        _check(not set(self.admin_keys) & set(self.api_keys), "an admin key may not also be a client API key")
        _check(self.path_policy in PATH_POLICIES, f"path_policy must be one of {PATH_POLICIES}")
        _check(self.stall_weight >= 0, "stall_weight must be >= 0")
        _check(self.prefill_choice in PREFILL_CHOICES, f"prefill_choice must be one of {PREFILL_CHOICES}")
        _check(self.prefill_spill_ms >= 0, "prefill_spill_ms must be >= 0")
        _check(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _check(self.vllm_retention_lease_s > 5, "vllm_retention_lease_s must be above 5 s")
        _check(self.kv_recompute_threshold_tokens >= 0, "kv_recompute_threshold_tokens must be >= 0")
        _check(all(h and h.isascii() and ":" not in h and not any(c.isspace() for c in h)
                   for h in self.session_headers), "a session header must be an HTTP header name")


@dataclass(slots=True)
class SupervisorConfig:
    """How `kvturn serve` (any supervised LocalStack) restarts a worker or router that exited."""
    restart: bool = setting(True, "start a worker or router that exited again, on its port, with its arguments")
    restart_backoff_s: float = setting(0.5, "wait before restarting a process that exited, s; doubled at each exit "
                                            "that follows a restart too soon (a crash loop)")
    restart_backoff_max_s: float = setting(30.0, "longest wait before a restart, s")
    restart_settled_s: float = setting(60.0, "a process that ran this long before it exited counts as settled: its "
                                             "restart waits restart_backoff_s again, s")

    def __post_init__(self):
        _positive(self, "restart_backoff_s", "restart_backoff_max_s", "restart_settled_s")
        _check(self.restart_backoff_s <= self.restart_backoff_max_s,
               "restart_backoff_s must be at most restart_backoff_max_s")
