"""Prefill/decode disaggregation: the router and the two worker roles, and what runs between them.

    router.py, request_run.py, router_app.py    the router: admission, policies, one run of a request
    queue/                                      how a prefill job reaches a prefill worker (memory, Redis)
    prefill_service.py, decode_service.py       the two roles' request handling; worker_app.py wires a worker
    kv_side.py, kv_link.py, worker_core.py      the KV side of a worker's engine process, and its stand-ins
    transport/                                  moving KV between workers (tcp, nixl, fake)
    control.py, client.py, handoff.py           the messages between them, and the one client of /pd/*
    attempt_states.py, request_ids.py           the states of a request's run, reservation and attempt; its ids
    router_stats.py, worker_stats.py            what the router and a worker's service show of themselves
    router_metrics.py, worker_metrics.py        ... as Prometheus series (and the router's dashboard pool)
See docs/ARCHITECTURE.md ("One request's lifecycle (disaggregated)").
"""
