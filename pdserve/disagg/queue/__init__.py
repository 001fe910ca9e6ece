"""The prefill job queue between routers and prefill workers (see base.py for the contract)."""

from pdserve.disagg.queue.base import PrefillQueue, QueueUnavailable, next_attempt

__all__ = ["PrefillQueue", "QueueUnavailable", "make_queue", "next_attempt"]


def make_queue(url: str | None, **options: object) -> PrefillQueue | None:
    """None for the in-memory default (the router pushes to its prefill workers itself); a Redis
    Streams queue for `redis://host:port/db`."""
    if not url or url == "memory":
        return None
    if url.startswith(("redis://", "rediss://", "unix://")):
        from pdserve.disagg.queue.redis_streams import RedisPrefillQueue

        return RedisPrefillQueue(url, **options)  # type: ignore[arg-type]
    raise ValueError(f"--queue must be 'memory' or a redis:// URL, got {url!r}")
