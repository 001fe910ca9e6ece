"""A worker's performance profile: how long one engine step takes, how fast KV moves.

Step-time model (affine in five counts of the step's work; one model for prefill-only, decode-only
and mixed steps, as one engine step runs them all in one forward):

    step_s = base_s                                   per step (weights read once, launch, scheduler)
           + prefill_token_s * prefill tokens         prompt tokens computed this step (matmuls)
           + prefill_pair_s  * prefill pairs          sum over chunks of new x (context before + new/2)
                                                      (attention of the new tokens over the whole prefix)
           + decode_seq_s    * decode sequences       one token each (matmuls, sampling)
           + decode_context_s * decode context tokens the KV every decoding sequence reads

Transfer model per transport: seconds = latency_s + bytes / bytes_per_s. With layer-wise streaming
layer l's KV leaves as soon as prefill computed it, so after the prefill step ends
only max(one layer's share, whole transfer - prefill time x (L-1)/L) is still in flight.

A profile is measured on this machine (`pdserve calibrate`) or derived from a GPU's datasheet
(`roofline`): decode reads the weights and the KV at `bw_efficiency` x HBM bandwidth, prefill
computes at `flops_efficiency` x dense BF16 FLOPs; the two costs add (no overlap: conservative).

What a PD request costs beyond its steps and its KV transfer (`PDPathCosts`, profile versions 2 and 3):
the router, the `/pd/*` HTTP hops, the early first token's way back, the hand-off's messages and
the decode worker's token relay through the router. `pdserve calibrate` measures them with a small
real PD run (`sizing/served_pd.py`), with the served steps of its prefill and decode workers
(`prefill_step`, `decode_step`). A version-1 profile (or a roofline one) has none: it loads with
`pd_path` None, which the simulator charges as zero (and `pdserve simulate` says so).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pdserve.model.facts import ModelFacts
from pdserve.sizing.devices import DeviceSpec

# NOTE: roofline efficiencies: what serving engines typically reach (decode ~70 % of HBM bandwidth,
# prefill ~50 % MFU), and a fixed per-step cost (kernel launches, scheduler, sampling) of 2 ms.
BW_EFFICIENCY = 0.7
FLOPS_EFFICIENCY = 0.5
STEP_OVERHEAD_S = 0.002
# NOTE: the seed's transfer numbers (DIGEST 9): 32K tokens of KV (~8.6 GB) took 3.8 s over TCP
# and 0.4 s over eRDMA; with GPUDirect a 1500-token KV (~0.39 GB at that rate) took 6 ms. Its
# other pairs (27 ms -> 0.8 ms, 42 ms over TCP for 1500 tokens) do not agree with these rates and
# are not used. Latencies are assumptions (one round trip and a setup).
SEED_TRANSPORTS = {
    "tcp": (1e-3, 8.6e9 / 3.8),
    "erdma": (1e-4, 8.6e9 / 0.4),
    "gdr": (5e-5, 0.39e9 / 0.006),
}


@dataclass(frozen=True, slots=True)
class StepModel:
    base_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_context_s: float

    def step_s(self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, decode_context: int) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens + self.prefill_pair_s * prefill_pairs
                + self.decode_seq_s * decode_seqs + self.decode_context_s * decode_context)


@dataclass(frozen=True, slots=True)
class TransferModel:
    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s

    def exposed_s(self, num_bytes: float, prefill_s: float, num_layers: int) -> float:
        """What is left after the prefill step when layers stream as they are computed."""
        whole = num_bytes / self.bytes_per_s
        hidden = prefill_s * (num_layers - 1) / max(1, num_layers)
        return self.latency_s + max(whole / max(1, num_layers), whole - hidden)


# NOTE: 1: steps and transfers only; 2: + `prefill_step` and `pd_path` (the PD path's fixed costs);
# 3: the load-dependent costs: the first token's per other request in flight, the hand-off's per other
# request not yet at decode (2: per request waiting for its first token, per stream decoding);
# 4: the first token's per other request in flight past its first token (3: per other request in flight)
PROFILE_VERSION = 4


@dataclass(frozen=True, slots=True)
class PDPathCosts:
    """A PD request's costs beyond what the simulator models itself (its client's dispatch, the
    prefill and decode steps, the KV transfer model), each a fixed part and a part that grows with
    the work the router and the workers' API servers have in hand when it is paid: the first token's
    per other request in flight past its own first token (streaming: each one's tokens are relayed
    by the router's and the workers' event loops, which on a CPU host also share the cores), the
    hand-off's per other request not yet at its decode worker (waiting for its first token, or
    handed off and not yet taken by decode: each one's hand-off messages, reservation bookkeeping
    and KV arrival are serial work of the same loops and of the decode worker's engine process, so
    a wave's first hand-offs wait behind the rest of it).

    What the first token's cost counts was found on served runs (the git history of docs/BENCHMARKS.md):
    per request waiting for its first token (profile version 2) it was ~0 once arrivals spread out
    and a steady load's TTFT came out 62 % short; per request in flight (version 3) a wave's first
    tokens paid for the seven others waiting with them, and the loop's 48-prompt TTFT median came
    out +16 %; fitted as two costs, per waiting and per streaming, the waiting one came out
    0-12 ms from session to session, traded against the hand-off's, and the streaming one with it.
    Per request streaming, a wave's first tokens pay for nothing the prefill step's batch does
    not already hold them back by, and the fitted cost agrees between sessions (3.9-5.8 ms).

    first_token_s (+ first_token_per_streaming_s x others streaming): from the prefill step that
        sampled the first token to the client having it, and the way in before that step (the
        router, the job's POST to prefill, prefill's answer line, the router's SSE frame): added to
        the first token's time. The first tokens of one prefill step leave together, none counting
        the others of its step. The load-dependent part is a delay of the relay all of a request's
        tokens take (the router's and the workers' loops), so every later token and the request's
        end take it too: charged to the first token alone, it shortened the simulated gap to the
        second token (0 for a tenth of the requests, against 10-37 ms real at p10) and a steady
        load's TPOT.
    handoff_s (+ handoff_per_waiting_s x others not yet at decode): from the simulated transfer's end
        to the decode worker stepping the request (the hand-off's messages, the reservation's
        bookkeeping, the decode tokens' relay): the decode worker gets the request this much later.

    `pdserve calibrate` measures the fixed parts on isolated requests and the load-dependent parts
    under a load (sizing/served_pd.py)."""

    first_token_s: float = 0.0
    handoff_s: float = 0.0
    first_token_per_streaming_s: float = 0.0
    handoff_per_waiting_s: float = 0.0
    transport: str = ""  # the KV transport of the run that measured them
    num_requests: int = 0  # the isolated requests the fixed parts are the medians of
    num_loads: int = 0  # the loads the load-dependent parts are the median of the fits of

    def relay_delay(self, streaming: int) -> float:
        """The first token's load-dependent part, with `streaming` other requests streaming: a delay
        of the relay, which every later token and the request's end take too."""
        return self.first_token_per_streaming_s * streaming

    def handoff(self, waiting: int) -> float:
        return self.handoff_s + self.handoff_per_waiting_s * waiting


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    source: str  # "calibrated on <hardware>" or "roofline <device>"
    model: ModelFacts
    step: StepModel
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    transports: dict[str, TransferModel] = field(default_factory=dict)
    notes: str = ""
    decode_step: StepModel | None = None  # PD decode workers' own, when fitted apart (else `step`)
    prefill_step: StepModel | None = None  # PD prefill workers' own, when measured served (else `step`)
    pd_path: PDPathCosts | None = None  # None: not measured (version 1, roofline): charged as zero
    version: int = PROFILE_VERSION

    def with_limits(self, num_kv_blocks: int | None = None, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None) -> Profile:
        return replace(self, num_kv_blocks=num_kv_blocks or self.num_kv_blocks,
                       max_num_seqs=max_num_seqs or self.max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens or self.max_num_batched_tokens)

    def transport(self, name: str) -> TransferModel:
        if name in self.transports:
            return self.transports[name]
        if name in SEED_TRANSPORTS:
            return TransferModel(*SEED_TRANSPORTS[name])
        raise ValueError(f"profile {self.name!r} has no transport {name!r}: one of "
                         f"{', '.join(sorted({*self.transports, *SEED_TRANSPORTS}))}")

    def to_dict(self) -> dict:
        return {**asdict(self), "model": self.model.to_dict()}  # the model as sizing's numbers, not its config

    @classmethod
    def from_dict(cls, raw: dict) -> Profile:
        """Any version up to PROFILE_VERSION; a version-1 file (no "version" key) has no served
        prefill step and no PD path costs; a version-2 or -3 file's load-dependent costs (counted
        other ways) are dropped, which its notes say: recalibrate for version 4's."""
        version = int(raw.get("version", 1))
        if version > PROFILE_VERSION:
            raise ValueError(f"profile version {version} is newer than this pdserve's ({PROFILE_VERSION})")
        path = dict(raw["pd_path"]) if raw.get("pd_path") else None
        old = {2: ("first_token_per_waiting_s", "handoff_per_stream_s"),
               3: ("first_token_per_in_flight_s", "handoff_per_waiting_s")}.get(version, ())
        if path is not None and any([path.pop(key, 0.0) for key in old]):
            raw = {**raw, "notes": f"{raw.get('notes', '')}; version {version}: its load-dependent PD path costs "
                                   "are not used (recalibrate)"}
        return cls(raw["name"], raw["source"], ModelFacts.from_dict(raw["model"]), StepModel(**raw["step"]),
                   int(raw["kv_bytes_per_token"]), int(raw["block_size"]), int(raw["num_kv_blocks"]),
                   int(raw["max_num_seqs"]), int(raw["max_num_batched_tokens"]),
                   {k: TransferModel(**v) for k, v in raw.get("transports", {}).items()}, raw.get("notes", ""),
                   StepModel(**raw["decode_step"]) if raw.get("decode_step") else None,
                   StepModel(**raw["prefill_step"]) if raw.get("prefill_step") else None,
                   PDPathCosts(**path) if path is not None else None, version)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def load_profile(path: Path) -> Profile:
    try:
        return Profile.from_dict(json.loads(Path(path).read_text()))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a pdserve profile ({exc!r})") from None


@dataclass(frozen=True, slots=True)
class Limits:
    """An engine's KV pool and batch limits, as a profile carries them."""

    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class Placement:
    """How the model runs: tensor-parallel ranks, bytes per weight element and per KV element."""

    tp: int = 1
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2


def roofline(model: ModelFacts, device: DeviceSpec, limits: Limits, placement: Placement = Placement(), *,
             bw_efficiency: float = BW_EFFICIENCY, flops_efficiency: float = FLOPS_EFFICIENCY) -> Profile:
    """A datasheet profile: every step reads one rank's (active: a token's experts) weights; decode
    reads each sequence's KV; each token costs 2 FLOPs per matmul parameter (of MoE layers, its
    top-k experts'); attention 4 x layers x heads x head_dim per pair."""
    tp, dtype_bytes, kv_dtype_bytes = placement.tp, placement.dtype_bytes, placement.kv_dtype_bytes
    bw = device.bandwidth_bytes_per_s * bw_efficiency
    flops = device.flops_per_s * flops_efficiency
    per_token_flops = 2.0 * model.matmul_params / tp
    kv_per_token = model.kv_bytes_per_token(kv_dtype_bytes, tp)
    step = StepModel(base_s=STEP_OVERHEAD_S + model.num_active_params * dtype_bytes / tp / bw,
                     prefill_token_s=per_token_flops / flops,
                     prefill_pair_s=model.attention_flops_per_pair(tp) / flops,
                     decode_seq_s=per_token_flops / flops,
                     decode_context_s=kv_per_token / bw)
    notes = (f"roofline: {device.describe()}, TP {tp}; bandwidth efficiency {bw_efficiency:g}, FLOPs efficiency "
             f"{flops_efficiency:g}, step overhead {STEP_OVERHEAD_S * 1e3:g} ms; memory and compute costs add")
    return Profile(f"{model.name}@{device.name}", f"roofline {device.name}", model, step, kv_per_token,
                   limits.block_size, limits.num_kv_blocks, limits.max_num_seqs, limits.max_num_batched_tokens,
                   notes=notes)
