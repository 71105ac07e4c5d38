"""Plain counters the engine keeps; the server exports them to Prometheus at scrape time."""
from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0  # served from the local prefix cache
    prompt_tokens_cached_host: int = 0  # ...of them, copied back from the prefix cache's host tier
    prompt_tokens_remote: int = 0  # read from a peer over NIXL
    generation_tokens: int = 0
