"""`python -m pdserve.bench.router_cost` (issue 34): the router's CPU per streamed chunk, over
model-less stand-ins that stream what a real decode worker streams. No timing is asserted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdserve.bench import frame_delivery, router_cost
from pdserve.bench.router_standins import FrameBook, next_step, token_cycle
from pdserve.disagg.control import FrameDecoder, OutputFrame
from pdserve.model.demo_checkpoint import default_model_dir
from pdserve.tokenizer import load_tokenizer


def test_decode_standin_frames_are_what_a_decode_worker_streams() -> None:
    tokenizer = load_tokenizer(str(default_model_dir("tiny")))
    cycle = token_cycle(tokenizer, 16)
    assert len(cycle) == 16 and not set(cycle) & set(tokenizer.eos_token_ids)
    book = FrameBook(tokenizer)
    frames = [OutputFrame.model_validate_json(line) for line in book.lines(20)]
    assert len(frames) == 20
    assert [f.finish_reason for f in frames] == [None] * 19 + ["length"]
    decoder = FrameDecoder()
    for index, frame in enumerate(frames):  # deltas, as a decode worker's: one token each
        assert frame.frame_no == index and frame.num_tokens_before == index
        assert frame.token_ids == [book.cycle[index % len(book.cycle)]]
        decoder.check(frame)
        seq = decoder.sequences(frame)[0]
        assert seq.token_ids == [book.cycle[i % len(book.cycle)] for i in range(index + 1)]
        assert seq.text == tokenizer.decode(seq.token_ids)
    assert frames[0].token_ids == [book.first_token()]  # what prefill sends as the early first token


@pytest.mark.slow  # three processes
@pytest.mark.parametrize("frame_mux", ["--frame-mux", "--no-frame-mux"])
def test_bench_counts_every_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str], frame_mux: str) -> None:
    out = tmp_path / "result.json"
    floor = ["--floor", "--step-ms", "5"] if frame_mux == "--frame-mux" else []
    code = router_cost.main(["--streams", "2", "--tokens", "8", "--stream", "both", "--min-chunks", "0",
                             "--idle-s", "0.5", "--json", str(out), frame_mux, *floor])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["idle_router_cpu_ms_per_s"] >= 0
    rows = result["rows"]
    assert [(r["streams"], r["stream"]) for r in rows] == [(2, True), (2, False)]
    for row in rows:
        assert row["chunks"] == row["expected_chunks"] == 2 * 8 * row["waves"]
        assert row["router_cpu_s"] >= 0 and row["wall_s"] > 0 and row["tok_per_s"] > 0
        assert row["user_us_per_chunk"] + row["sys_us_per_chunk"] == pytest.approx(row["us_per_chunk"])
    assert result["frame_mux"] == (frame_mux == "--frame-mux")
    printed = capsys.readouterr().out
    assert "µs/chunk" in printed and "chunks/s/core" in printed
    if floor:  # the relay floor, bare and through the serving stack, under the streamed load only
        floors = result["floor_rows"]
        assert [(r["stack"], r["streams"], r["stream"]) for r in floors] == [("bare", 2, True), ("serving", 2, True)]
        for row in floors:
            assert row["chunks"] == row["expected_chunks"] == 2 * 8 * row["waves"]
        assert "router / floor" in printed


def test_frame_delivery_bench_times_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    assert frame_delivery.main(["--streams", "4", "--steps", "5", "--rounds", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["pump", "direct"]
    assert all(float(line.split()[1]) > 0 for line in printed)


def test_standin_streams_share_one_step_clock() -> None:
    """Streams that started apart wake on the same tick, as a real decode step's tokens come
    together (each sleeping its own step drifted: one write a step became many)."""

    async def woken(delay_s: float) -> float:
        await asyncio.sleep(delay_s)
        await next_step(0.1)
        return asyncio.get_running_loop().time()

    async def main() -> list[float]:
        await next_step(0.1)  # NOTE: just past a tick: the three start within one step
        return list(await asyncio.gather(woken(0.0), woken(0.01), woken(0.03)))

    times = asyncio.run(main())
    assert max(times) - min(times) < 0.02, times


def test_the_floor_needs_a_step(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        router_cost.main(["--floor", "--step-ms", "0"])
    assert "--floor needs --step-ms > 0" in capsys.readouterr().err
