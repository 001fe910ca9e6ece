"""A prefill or decode worker: its HTTP control plane, its role's service, and its KV side.

    app.py               the worker's HTTP app (`/pd/*` control API, OpenAI API, /metrics); routes.py: its routes
    prefill_service.py   prefill: take a job, compute the prompt in chunks, stream each layer's KV to decode
    decode_service.py    decode: reserve blocks, receive the KV, decode on
    queue_consumer.py    a prefill worker's consumer of the Redis Streams queue
    registrar.py         registration with a router (`--register`)
    core.py              the engine process of a worker (`python -m pdserve.disagg.worker.core FD`)
    kv_side.py           the engine side of the KV transport; kv_link.py: the API process's view of it
    kv_streamer.py       prefill: "layer l is computed" -> per-layer block sends; sender_pool.py: one sender per peer
    rank_streaming.py    prefill under tensor parallelism (a KV pool per rank); rank_receiving.py: decode's side
    stats.py             what a worker's service has done; metrics.py: as Prometheus series

Imports point one way: worker/ uses what disagg/ shares (its top-level modules, transport/,
queue/) and never router/.
"""
