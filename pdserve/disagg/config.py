"""The disaggregation layer's configuration: the router's (`RouterConfig`), a prefill or decode
worker's (`WorkerConfig`) and the prefill queue's (`QueueArgs`). Built once at the edge (CLI,
`pdserve up`), validated, frozen, passed down; flags come from the fields (config_flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.addresses import is_http_url, parse_allow, parse_host_port, parse_member
from pdserve.config import knob

DecodePolicyName = Literal["least-loaded", "round-robin", "prefix-affinity", "kv-events"]
DECODE_POLICIES: tuple[DecodePolicyName, ...] = ("least-loaded", "round-robin", "prefix-affinity", "kv-events")
PrefillPolicyName = Literal["least-loaded", "prefix-affinity", "kv-events"]
PREFILL_POLICIES: tuple[PrefillPolicyName, ...] = ("least-loaded", "prefix-affinity", "kv-events")


@dataclass(frozen=True, slots=True)
class QueueArgs:
    """The prefill job queue, as routers and prefill workers see it (`--queue*` flags)."""

    queue: str = knob("memory", "'memory' (the router's own FIFO) or redis://host:port/db (Redis Streams, shared "
                                "by every router and prefill worker)")
    queue_deployment: str = knob("default", "Redis key namespace: one stream per deployment")

    def validate(self) -> None:
        if self.queue != "memory" and not self.queue.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--queue must be 'memory' or a redis:// URL, got {self.queue!r}")


CLUSTER_SECRET_HELP = ("file holding the secret every router and worker of the cluster shares (env "
                       "PDSERVE_CLUSTER_SECRET otherwise): signs /pd/* calls, KV handshakes and prefill jobs; "
                       "none: peers are not authenticated")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the PD router needs besides the model (tokenizer, context window)."""

    prefill: tuple[str, ...] = knob((), "prefill workers: URLs and/or dns:NAME:PORT (every A/AAAA record of NAME a "
                                        "worker; optional with a Redis queue: its consumers are the prefill pool)")
    decode: tuple[str, ...] = knob((), "decode workers: URLs and/or dns:NAME:PORT (every A/AAAA record of NAME a "
                                       "worker, re-resolved every --dns-interval-s)")
    accept_registrations: bool = knob(False, "let workers join the pool by POST /pd/register (their --register flag)")
    registration_ttl_s: float = knob(10.0, "a registered worker silent this long is forgotten (workers re-announce "
                                           "every 2 s)")
    dns_server: str = knob("", "HOST[:PORT] of the DNS server for dns: members (default: the system's resolver)")
    dns_interval_s: float = knob(2.0, "how often dns: members are resolved again")
    cluster_secret_file: str | None = knob(None, CLUSTER_SECRET_HELP)
    queue: QueueArgs = field(default_factory=QueueArgs)
    decode_policy: DecodePolicyName = knob("least-loaded", "which decode worker gets a request: least-loaded, "
                                           "round-robin, prefix-affinity (asks each worker what it caches), or "
                                           "kv-events (the workers' KV-cache events say: their --kv-events-config)")
    prefill_policy: PrefillPolicyName = knob("least-loaded", "which prefill worker gets a first attempt's job "
                                             "(memory queue): least-loaded, prefix-affinity (the one caching the "
                                             "longest prefix, pool or disk tier, asked per job), or kv-events (the "
                                             "same from the prefill workers' KV-cache events); a resume after a "
                                             "decode loss always uses prefix-affinity")
    pd_threshold: int = knob(0, "prompts whose part not cached on the chosen decode worker is shorter than this "
                                "many tokens are prefilled there (0: always disaggregate)")
    max_queued_requests: int = knob(512, "requests admitted and waiting for their first token; beyond: 429")
    max_queued_tokens: int = knob(1 << 20, "their prompt tokens; beyond: 429")
    reserve_deadline_s: float = knob(30.0, "how long a request waits for KV room on a decode worker before a 503")
    restart_window_s: float = knob(5.0, "a new request finding no ready prefill or decode worker while one that "
                                        "was ready is expected back (restarting: still listed, or a Redis queue "
                                        "that had consumers) waits this long for it before a 503 with Retry-After "
                                        "(0: the 503 at once); also while a fresh router expects its first workers "
                                        "(--startup-window-s)")
    startup_window_s: float = knob(300.0, "for this long after a router starts, a role that has had no ready "
                                          "worker yet is expected (its workers are loading or have not registered): "
                                          "a new request waits up to --restart-window-s for one rather than a 503 at "
                                          "once (0: no such wait)")
    max_resumes: int = knob(2, "times a request moves to another decode worker after losing its own")
    early_first_token: bool = knob(True, "send a request's first token to its client as soon as the prefill worker "
                                         "sampled it, before decode has the KV (memory queue; one sequence, no "
                                         "logprobs; see disagg/router/outputs.py)")
    frame_mux: bool = knob(True, "stream the frames of every request on a decode worker over one connection "
                                 "(a step's frames in one write and one read; worker/frame_mux.py) rather than "
                                 "one stream per request (a worker without it gets those)")
    first_token_timeout_s: float = knob(300.0, "a request with no first token this long after it arrived gets a "
                                               "503 and is aborted on every worker (0: no deadline)")
    enable_lora: bool = knob(False, "LoRA adapters: /v1/models lists the workers' adapters, a request's `model` "
                                    "picks one, load/unload go to every worker of both roles (up: the workers get "
                                    "--enable-lora and the LoRA flags too)")

    def validate(self) -> None:
        self.queue.validate()
        checks = [
            (bool(self.decode) or self.accept_registrations,
             "the router needs decode workers (--decode URL or dns:NAME:PORT, or --accept-registrations)"),
            (bool(self.prefill) or self.queue.queue != "memory" or self.accept_registrations,
             "the router needs prefill workers (--prefill, --accept-registrations), or a shared (Redis) queue whose "
             "consumers are the prefill pool"),
            (self.registration_ttl_s > 0, "registration_ttl_s must be > 0"),
            (self.dns_interval_s > 0, "dns_interval_s must be > 0"),
            (self.decode_policy in DECODE_POLICIES,
             f"decode policy must be one of {DECODE_POLICIES}, got {self.decode_policy!r}"),
            (self.prefill_policy in PREFILL_POLICIES,
             f"prefill policy must be one of {PREFILL_POLICIES}, got {self.prefill_policy!r}"),
            (self.pd_threshold >= 0, "pd_threshold must be >= 0"),
            (self.max_queued_requests >= 1, "max_queued_requests must be >= 1"),
            (self.max_queued_tokens >= 1, "max_queued_tokens must be >= 1"),
            (self.reserve_deadline_s >= 0, "reserve_deadline_s must be >= 0 (0: try each decode worker once)"),
            (self.restart_window_s >= 0, "restart_window_s must be >= 0 (0: no window)"),
            (self.startup_window_s >= 0, "startup_window_s must be >= 0 (0: no window)"),
            (self.max_resumes >= 0, "max_resumes must be >= 0"),
            (self.first_token_timeout_s >= 0, "first_token_timeout_s must be >= 0 (0: no deadline)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for member in (*self.prefill, *self.decode):
            parse_member(member)
        if self.dns_server:
            parse_host_port(self.dns_server, 53)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A prefill or decode worker's disaggregation settings (its engine has `EngineArgs`)."""

    role: Literal["prefill", "decode"] = knob("decode", "which half of a request this worker computes")
    kv_transport: Literal["nixl", "tcp"] | None = knob(None, "default: nixl when importable, else tcp")
    kv_host: str = knob("127.0.0.1", "decode role: address the KV receiver binds")
    kv_port: int = knob(0, "decode role: KV receiver port (0: any free port)")
    kv_transfer_timeout_ms: int | None = knob(
        None, "time a KV hand-off may go without progress (env KV_TRANSFER_TIMEOUT_MS, default 100)")
    kv_failure_policy: Literal["recompute", "fail"] = knob(
        "recompute", "after a timeout and one retry: prefill on the decode worker, or fail the request")
    queue: QueueArgs = field(default_factory=QueueArgs)
    register: tuple[str, ...] = knob((), "router URLs to join (POST /pd/register once serving, again every 2 s; "
                                         "leave on drain)")
    advertise_url: str | None = knob(None, "the URL routers reach this worker at (default http://HOST:PORT)")
    queue_claim_idle_s: float = knob(5.0, "prefill: re-deliver a job whose consumer went silent this long")
    reservation_lease_s: float = knob(60.0, "decode: a reservation that hears neither KV nor a prefill keepalive "
                                            "this long is ended with an error and its blocks freed (0: never)")
    queue_max_deliveries: int = knob(3, "prefill: dead-letter a job after this many deliveries")
    placement_timeout_s: float = knob(1.0, "prefill: a job sent before its decode reservation was made is dropped "
                                           "(its blocks freed) if the reservation is not named this long after "
                                           "its prompt was computed (at least the KV transfer timeout; longer, "
                                           "up to 30 s, while the router that sent it still listens)")
    cluster_secret_file: str | None = knob(None, CLUSTER_SECRET_HELP)
    kv_max_connections: int = knob(64, "decode: most connections the KV port holds at once (when full, the "
                                       "oldest one not yet authenticated is dropped for a newcomer)")
    kv_handshake_timeout_s: float = knob(5.0, "decode: a KV connection that has not authenticated this long is closed")
    gateway: bool = knob(True, "decode: also answer /v1/completions and /v1/chat/completions itself, as an endpoint "
                               "picker's target (llm-d): the header x-prefiller-host-port names the prefill worker "
                               "to send the job to; without it, the prompt is prefilled here")
    gateway_prefill_timeout_s: float = knob(5.0, "decode gateway: a prefill worker named by x-prefiller-host-port "
                                                 "that has not taken the job this long is given up on and the "
                                                 "prompt prefilled here")
    gateway_prefill_allow: tuple[str, ...] = knob((), "decode gateway: the prefill workers x-prefiller-host-port "
                                                      "may name: IP addresses, CIDRs (10.0.0.0/8), dns:NAME (what "
                                                      "NAME resolves to, again every 5 s); another is not contacted, "
                                                      "the prompt is prefilled here (none: any)")

    def validate(self) -> None:
        self.queue.validate()
        checks = [
            (self.role in ("prefill", "decode"), f"role must be prefill or decode, got {self.role!r}"),
            (self.kv_transport in (None, "nixl", "tcp"), "kv_transport must be nixl or tcp"),
            (0 <= self.kv_port < 65536, "kv_port must be in [0, 65535]"),
            (self.kv_transfer_timeout_ms is None or self.kv_transfer_timeout_ms >= 1,
             "kv_transfer_timeout_ms must be >= 1"),
            (self.kv_failure_policy in ("recompute", "fail"), "kv_failure_policy must be recompute or fail"),
            (self.queue_claim_idle_s > 0, "queue_claim_idle_s must be > 0"),
            (self.reservation_lease_s >= 0, "reservation_lease_s must be >= 0 (0: no lease)"),
            (self.queue_max_deliveries >= 1, "queue_max_deliveries must be >= 1"),
            (self.placement_timeout_s > 0, "placement_timeout_s must be > 0"),
            (self.kv_max_connections >= 1, "kv_max_connections must be >= 1"),
            (self.kv_handshake_timeout_s > 0, "kv_handshake_timeout_s must be > 0"),
            (self.gateway_prefill_timeout_s > 0, "gateway_prefill_timeout_s must be > 0"),
            (all(is_http_url(u) for u in self.register), "--register takes router URLs like http://host:port"),
            (self.advertise_url is None or is_http_url(self.advertise_url),
             "--advertise-url must be a URL like http://host:port"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        try:
            parse_allow(self.gateway_prefill_allow)
        except ValueError as exc:
            raise ValueError(f"--gateway-prefill-allow: {exc}") from exc

    @property
    def transfer_timeout_s(self) -> float:
        """The flag, else the environment (envs.py), in seconds."""
        from pdserve import envs

        return (self.kv_transfer_timeout_ms or envs.kv_transfer_timeout_ms()) / 1000
