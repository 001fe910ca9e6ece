"""Prefill/decode disaggregation: the router and the two worker roles, and what runs between them.

    router/                                     the router: admission, policies, one run of a request, its pool
    worker/                                     a prefill or decode worker: its app, services and KV side
    queue/                                      how a prefill job reaches a prefill worker (the contract; Redis)
    transport/                                  moving KV between workers (tcp, nixl, fake)
    config.py                                   the router's and a worker's configuration
    control.py, client.py, auth.py              the control-plane messages, the one client of /pd/*, signing
    handoff.py, kv_layout.py, wire.py           the hand-off record, the KV layout handshake, typed JSON
    phases.py, prompt_logprobs_wire.py          what travels back with a request (TTFT phases, prompt logprobs)
    attempt_states.py, request_ids.py           the states of a request's run, reservation and attempt; its ids
Imports point one way: router/ and worker/ use the modules here, transport/ and queue/; those never
import router/ or worker/, and router/ and worker/ never import each other.
See docs/ARCHITECTURE.md ("One request's lifecycle (disaggregated)").
"""
