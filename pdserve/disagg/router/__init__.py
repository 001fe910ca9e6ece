"""The PD router: one OpenAI-compatible endpoint over P prefill and D decode workers.

    core.py           `PDRouter`: the engine the OpenAI handlers see (serving/app.py)
    app.py            its HTTP app: the OpenAI API, /workers, /router/stats, /metrics, /dashboard
    request_run.py    one run of a request: its decode reservation and prefill attempts, resumed on loss
    outputs.py        what the client sees of the workers' outputs (first token, then decode's stream)
    admission.py      decisions before anything is queued (queue full, no worker ready), and their counts
    policy.py         which decode worker gets a request
    pool.py           the workers: who they are, whether they answer, what they last advertised
    membership.py     where the pool's members come from (flags, registration, DNS)
    memory_queue.py   the router's own prefill FIFO (`--queue memory`) and `make_queue`
    errors.py         why the router ends a request
    stats.py          what the router shows of itself, as snapshots; metrics.py: as Prometheus series

Imports point one way: router/ uses what disagg/ shares (its top-level modules, transport/,
queue/) and never worker/.
"""
