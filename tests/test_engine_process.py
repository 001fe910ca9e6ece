"""The engine core in its own process (engine/core_proc.py, engine/core_client.py): the wire refuses
what it cannot decode; a dead engine process fails every request in flight (EngineDeadError: 503)
and the server exits non-zero; a dead API process takes its engine process with it. (`pdserve up`
restarting a replica whose engine process died: tests/test_up.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from helpers import greedy, random_prompt
from process_cluster import engine_process_of, pid_gone, spawn_worker, wait_healthy

from pdserve import LLM
from pdserve.config import EngineArgs
from pdserve.engine.async_llm import EngineDeadError
from pdserve.engine.commands import (
    Abort,
    AddLoRA,
    AddPrefillOnly,
    AddRequest,
    CachedPrefixTokens,
    Command,
    CompleteRemote,
    GeneratorState,
    ListLoRAs,
    PlaceKV,
    PrefillLocally,
    ReleaseKV,
    RemoveLoRA,
    ReserveRemote,
    StopSequence,
)
from pdserve.engine.core_client import EngineCoreClient, EngineStartError
from pdserve.engine.core_wire import (
    COMMANDS,
    WIRE_VERSION,
    CoreReply,
    CoreWireError,
    FrameReader,
    FromCore,
    ToCore,
    decode_from_core,
    decode_to_core,
    encode_from_core,
    encode_to_core,
    recv_frames,
)
from pdserve.engine.disk_offload import TierStats
from pdserve.engine.kv_disk_tier import KVTierStats
from pdserve.engine.kv_transfer import KVTarget
from pdserve.engine.link_writer import LinkWriter
from pdserve.engine.llm_engine import EngineStats
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.engine.output import RequestDelta, SequenceDelta, StepTokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutput

ENGINE_FAILED = 3  # cli._ENGINE_FAILED
FLAGS = ["--num-kv-blocks", "256", "--max-num-batched-tokens", "16"]


def _body(frame: bytes) -> bytes:
    (frame,) = FrameReader().feed(frame)
    return frame


def test_every_command_and_both_records_round_trip_and_a_bad_frame_is_refused() -> None:
    params = SamplingParams(n=2, seed=5, stop=("x",), logprobs=1)
    constrained = SamplingParams(structured=StructuredOutput("json", '{"type": "object"}'), structured_replay=1)
    target = KVTarget((4, 5, 6), 16, 3, "tcp://127.0.0.1:5000", "secret-token")
    commands: list[Command[Any]] = [
        AddRequest("r1", [1, 2, 3], params), AddRequest("r3", [1, 2, 3], constrained),  # a structured spec too
        AddPrefillOnly("p1", [1, 2], params, target), AddPrefillOnly("p2", [1, 2], params),
        ReserveRemote("d1", [1, 2, 3], params, "d1@1", "tok"), PlaceKV("p2", target), ReleaseKV("p1"),
        CompleteRemote("d1", 7, b"\x00state", 16, [None, PromptLogprobs(2, -2.0, 3, ((9, -0.1),))]),
        CompleteRemote("d2", 7), PrefillLocally("d1"), Abort("r1"), CachedPrefixTokens([1, 2, 3]),
        GeneratorState("p1"), StopSequence("r1", 1, "stop"),
        CompleteRemote("d3", 7, lora_name="sql", lora_digest="ab"), AddLoRA("sql", "/adapters/sql"),
        RemoveLoRA("sql"), ListLoRAs()]
    assert set(COMMANDS) == {type(c).__name__ for c in commands}, "a command that crosses the link is untested"
    for call_id, command in enumerate(commands):
        message = ToCore("command", call_id, command)
        assert decode_to_core(_body(encode_to_core(message))) == message
    kv = ToCore("kv", 9, kv=["flush", 3, "p1", 0.5])
    assert decode_to_core(_body(encode_to_core(kv))) == kv
    delta = RequestDelta("r1", [SequenceDelta(1, [4, 5], [TokenLogprobs(4, -0.5, ((4, -0.5),)),
                                                          TokenLogprobs(5, -1.0, ((6, -0.25),))], "stop", 5)],
                         3, 12.5, [None, PromptLogprobs(2, -2.0, 3, ((9, -0.1),))])
    message = FromCore([delta], [("r2", "boom")], [CoreReply(7, None, "in use", "value"), CoreReply(8, 32),
                                                   CoreReply(9, None, "mismatch", "kv_layout", ["dtype", "a", "b"])],
                       None, None, False, {"kv_address": "x"}, [["progress", "d1@1", 3, [4, 5]]], {"n": 2},
                       StepTokens(["r3", "r4"], [11, 0]))
    assert decode_from_core(_body(encode_from_core(message))) == message
    disk = KVTierStats(True, 1 << 30, 4096, 2, 3, 1, 0, 0, 8192, 4096, (1, 2, 0), 0.25)
    stats = EngineStats(**{f.name: 1 for f in dataclasses.fields(EngineStats)} | {  # type: ignore[arg-type]
        "kv_cache_usage": 0.5, "step_time_s": 1.5, "kv_tier": TierStats(disk, 6),
        "running_lora_adapters": ("sql",), "waiting_lora_adapters": ("chat", "sql")})
    assert decode_from_core(_body(encode_from_core(FromCore(stats=stats, ready=True)))).stats == stats
    with pytest.raises(CoreWireError, match="wire version"):
        decode_to_core(msgpack.packb([WIRE_VERSION + 1, "command", 0, ["Abort", "r"], None, None, None, "INFO",
                                      "text"]))
    with pytest.raises(CoreWireError, match="unknown kind"):
        decode_to_core(msgpack.packb([WIRE_VERSION, "exec", 0, None, None, None, None, "INFO", "text"]))
    with pytest.raises(CoreWireError, match="unknown 'Exec'"):  # only the commands named in COMMANDS
        decode_to_core(msgpack.packb([WIRE_VERSION, "command", 0, ["Exec", "r"], None, None, None, "INFO", "text"]))
    with pytest.raises(CoreWireError, match="n must be"):  # SamplingParams' own checks
        decode_to_core(msgpack.packb([WIRE_VERSION, "command", 1, ["AddRequest", "r", [1], {"n": 0}], None, None,
                                      None, "INFO", "text"]))
    with pytest.raises(CoreWireError, match="AddRequest.prompt_token_ids"):  # a bool is no token id
        decode_to_core(msgpack.packb([WIRE_VERSION, "command", 1, ["AddRequest", "r", [True], {}], None, None,
                                      None, "INFO", "text"]))
    with pytest.raises(CoreWireError, match="token_ids"):
        decode_from_core(msgpack.packb([WIRE_VERSION, [["r", [[0, ["1"], None, None, None]], 0, None, None]], [], [],
                                        None, None, False, None, [], None, [[], []]]))
    for alone, refusal in (([["r"], ["1"]], "alone token_ids"), ([["r"], []], "1 request ids for 0 tokens"),
                           ([[7], [1]], "alone request id"), ([["r"]], "FromCore.alone")):
        with pytest.raises(CoreWireError, match=refusal):
            decode_from_core(msgpack.packb([WIRE_VERSION, [], [], [], None, None, False, None, [], None, alone]))
    with pytest.raises(CoreWireError, match="not msgpack"):
        decode_from_core(b"\xc1")


def test_a_killed_engine_process_fails_its_requests_and_later_ones(model_dirs: dict[str, Path]) -> None:
    client = EngineCoreClient.start(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64))
    fatal: list[BaseException] = []
    client.on_fatal = fatal.append

    async def run_one(prompt: list[int], kill_after: int | None = None) -> BaseException | None:
        try:
            count = 0
            async for _ in client.generate(str(prompt[0]), prompt, greedy(400)):
                count += 1
                if count == kill_after:
                    os.kill(client.process.pid, signal.SIGKILL)
        except EngineDeadError as exc:
            return exc
        return None

    async def run_all() -> list[BaseException | None]:
        prompts = [random_prompt(20, seed=seed) for seed in range(3)]
        return await asyncio.wait_for(asyncio.gather(run_one(prompts[0], kill_after=3),
                                                     *(run_one(p) for p in prompts[1:])), timeout=60)

    try:
        errors = asyncio.run(run_all())
        assert all(isinstance(e, EngineDeadError) and "exited" in str(e) for e in errors), errors
        client._reader.join(10)  # on_fatal runs on the reader thread, after the errors went out
        assert not client.alive and len(fatal) == 1 and client.failure is fatal[0]
        assert isinstance(asyncio.run(run_one(random_prompt(5, seed=9))), EngineDeadError)  # refused at once
    finally:
        client.shutdown()


def test_an_engine_that_cannot_start_is_reported_with_its_reason(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    # NOTE: the API process reads the config and the tokenizer; only the engine process reads the weights
    broken = Path(shutil.copytree(model_dirs["tiny"], tmp_path / "broken"))
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    with pytest.raises(EngineStartError, match="failed to start"):
        EngineCoreClient.start(EngineArgs(model=str(broken), dtype="float32", num_kv_blocks=64))


@pytest.mark.slow
def test_a_server_whose_engine_process_is_killed_answers_503_and_exits_non_zero(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = spawn_worker("colocated", model_dirs["tiny"], tmp_path, FLAGS)
    try:
        wait_healthy([server])
        engine_pid = engine_process_of(server.popen.pid)
        body = {"prompt": random_prompt(20, seed=1), "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        os.kill(engine_pid, signal.SIGKILL)
        # the stream had started: its error comes in-band, then [DONE]; nothing hangs
        assert events[-1] == "data: [DONE]" and "engine failed" in events[-2], events[-3:]
        with contextlib.suppress(httpx.HTTPError):  # a request meanwhile: 503 (or refused once it closed)
            reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
            assert reply.status_code == 503, reply.text
        assert server.popen.wait(30) == ENGINE_FAILED, server.tail()
        assert "the engine core failed" in server.tail()
    finally:
        server.kill()


@pytest.mark.slow
def test_a_killed_server_takes_its_engine_process_with_it(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = spawn_worker("colocated", model_dirs["tiny"], tmp_path, FLAGS)
    try:
        wait_healthy([server])
        engine_pid = engine_process_of(server.popen.pid)
        body = {"prompt": random_prompt(20, seed=2), "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
        busy = threading.Thread(target=_post_quietly, args=(server.url, body), daemon=True)
        busy.start()
        time.sleep(1.0)  # the engine is stepping
        server.kill(signal.SIGKILL)
        server.popen.wait(10)
        assert pid_gone(engine_pid, 10), "the engine process outlived its server"
    finally:
        server.kill()


def _post_quietly(url: str, body: dict[str, object]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def test_a_tensor_parallel_engine_process_serves_what_one_process_does(model_dirs: dict[str, Path]) -> None:
    """--tensor-parallel-size 2 in the engine process: its rank 1 is that process's child; the same
    greedy tokens as the offline engine, nothing left held, and the ranks gone after shutdown."""
    prompts = [random_prompt(24, seed=seed) for seed in (11, 12)]
    offline = LLM(str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in offline.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   greedy(10))]
    offline.engine.close()
    client = EngineCoreClient.start(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64,
                                               tensor_parallel_size=2, num_threads=1))

    async def run_one(prompt: list[int]) -> list[int]:
        last = None
        async for output in client.generate(str(prompt[0]), prompt, greedy(10)):
            last = output
        assert last is not None
        return last.outputs[0].token_ids

    async def run_all() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(*(run_one(p) for p in prompts)), timeout=120)

    try:
        ranks = subprocess.run(["pgrep", "-P", str(client.process.pid), "-f", "pdserve.engine.tp_rank"],
                               capture_output=True, text=True).stdout.split()
        assert len(ranks) == 1, ranks
        assert asyncio.run(run_all()) == expected
        deadline = time.monotonic() + 5
        while client.stats().num_free_kv_blocks != client.stats().num_kv_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = client.stats()
        assert stats.num_engine_requests == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    finally:
        client.shutdown()
    assert client.process.returncode == 0 and pid_gone(int(ranks[0]), 10)


def test_the_disk_tier_and_the_prefix_cache_answer_through_the_engine_process(model_dirs: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """--kv-disk-dir in the engine process: its blocks are written there, its stats (TierStats) reach
    the API process's `stats()`, and `CachedPrefixTokens` is answered across the link."""
    client = EngineCoreClient.start(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64,
                                               kv_disk_dir=str(tmp_path / "kv")))
    prompt = random_prompt(80, seed=3)  # 5 blocks of 16 tokens; the last stays the prompt's own

    async def run() -> int:
        async for _ in client.generate("disk", prompt, greedy(2)):
            pass
        deadline = time.monotonic() + 10
        while True:  # NOTE: written behind, one block at a time; each command's reply brings the stats of the moment
            cached = await client.send(CachedPrefixTokens(prompt))
            tier = client.stats().kv_tier
            if tier is not None and tier.disk.num_files >= 4 or time.monotonic() > deadline:
                return cached
            await asyncio.sleep(0.05)

    try:
        assert asyncio.run(run()) == 64
        tier = client.stats().kv_tier
        assert tier is not None and tier.disk.enabled and tier.disk.bytes_written > 0 and tier.disk.num_files >= 4
    finally:
        client.shutdown()


def test_the_link_writer_keeps_frames_in_order_and_never_waits_on_a_slow_reader() -> None:
    """`LinkWriter`: while the other end does not read, sends return at once (what the socket does
    not take goes to the writer thread); once it reads, every frame arrives whole and in order, the
    ones sent directly and the queued ones alike."""
    ours, theirs = socket.socketpair()
    try:
        writer = LinkWriter(ours)
        frames = [encode_to_core(ToCore("command", call_id, CachedPrefixTokens(list(range(50_000)))))
                  for call_id in range(1, 61)]  # ~60 x 150 kB: far more than the socket's buffers
        started = time.monotonic()
        for frame in frames:
            writer.send(frame)
        assert time.monotonic() - started < 5.0, "a send waited for the reader"
        reader, got = FrameReader(), []
        while len(got) < len(frames):
            got += [decode_to_core(frame).call_id for frame in recv_frames(theirs, reader) or []]
        assert got == list(range(1, 61))
        writer.send(frames[0])  # nothing queued any more: sent directly, still whole
        (frame,) = recv_frames(theirs, reader) or []
        assert decode_to_core(frame).call_id == 1
        writer.close()
        writer.join(5.0)
    finally:
        ours.close()
        theirs.close()
