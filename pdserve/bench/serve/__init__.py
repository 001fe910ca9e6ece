"""`pdserve bench`: load-test any OpenAI-compatible server (pdserve, vLLM, SGLang, `transformers serve`).

workloads.py  what to send (seed mix, random, shared prefix, ShareGPT) and when (gamma arrivals)
client.py     one request -> one RequestRecord; run_load drives a workload (httpx, asyncio)
metrics.py    pure functions: TTFT, TPOT, ITL, E2E percentiles, throughput, goodput
report.py     the table, the JSON file (vLLM's key names), the plots
stub.py       a server that answers at once (client capacity, failure tests)
sweep.py      concurrency ladder; P:D ratio sweep on local `pdserve up` clusters
compare.py    colocated (chunked prefill on/off) vs PD on the same cores and workload
"""
