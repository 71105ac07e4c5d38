"""How kvturn talks to Redis: a client that fails fast, because Redis only ever saves work (a turn recomputes
without it), and that retries once on a fresh connection, because a Redis restart breaks the pooled ones."""
import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

ERRORS = (RedisError, OSError)  # what a call may raise when Redis is down, hung or restarting


def connect(url: str, timeout_s: float) -> redis.Redis:
    """`timeout_s` bounds the connect and each command (a hung Redis is not retried, a refused connection is)."""
    return redis.from_url(url, decode_responses=True, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                          retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
