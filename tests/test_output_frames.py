"""Decode's output frames are deltas (control.OutputFrame): O(new tokens) each, rebuilt by the router
into the cumulative outputs exactly, and a frame that does not follow the ones before it is refused
(an error for the request, never a wrong text)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.disagg.control import FrameDecoder, FrameEncoder, FrameGap, OutputFrame
from pdserve.disagg.router.errors import RouterError
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampler import PromptLogprobs, TokenLogprobs


def _output(seqs: list[CompletionOutput], prompt_logprobs: list[PromptLogprobs | None] | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], seqs, all(s.finished for s in seqs), 3, prompt_logprobs=prompt_logprobs)


def _cumulative(num_tokens: int, n: int = 1, logprobs: bool = False) -> list[RequestOutput]:
    """A stream's engine outputs, one token a step per sequence, the last finished."""
    outputs = []
    for step in range(1, num_tokens + 1):
        last = step == num_tokens
        seqs = [CompletionOutput(i, "".join(f"<{i}:{t}>" for t in range(step)), [100 * i + t for t in range(step)],
                                 "length" if last else None, None,
                                 [TokenLogprobs(100 * i + t, -t / 8, ((1, -0.5),)) for t in range(step)]
                                 if logprobs else None)
                for i in range(n)]
        outputs.append(_output(seqs, [None, PromptLogprobs(2, -1.5, 1, ((2, -1.5),))]))
    return outputs


def _wire(frame: OutputFrame) -> OutputFrame:
    return OutputFrame.model_validate_json(frame.model_dump_json())


@pytest.mark.parametrize(("n", "logprobs"), [(1, False), (1, True), (3, True)])
def test_a_long_stream_is_sent_as_deltas_and_rebuilt_exactly(n: int, logprobs: bool) -> None:
    outputs = _cumulative(300, n, logprobs)
    encoder, decoder = FrameEncoder(), FrameDecoder()
    sent_tokens = 0
    for index, output in enumerate(outputs):
        frame = _wire(encoder.frame(output))
        seqs = [frame] + list(frame.other_sequences)
        assert all(len(s.token_ids) == 1 and (s.logprobs is None or len(s.logprobs) == 1) for s in seqs)
        assert all(s.num_tokens_before == index for s in seqs)
        assert (frame.prompt_logprobs is not None) == (index == 0)  # once, with the first frame
        sent_tokens += len(frame.token_ids)
        decoder.check(frame)
        assert decoder.sequences(frame) == output.outputs
    assert sent_tokens == 300


def test_text_that_changes_earlier_characters_is_sent_from_where_it_changed() -> None:
    """(An engine's cumulative text may rewrite its tail: the frame says from which character.)"""
    texts = ["ab", "abc\ufffd", "abcé", "abcéd", "ab", "abXY"]
    encoder, decoder = FrameEncoder(), FrameDecoder()
    for step, text in enumerate(texts):
        output = _output([CompletionOutput(0, text, list(range(step + 1)))])
        frame = _wire(encoder.frame(output))
        decoder.check(frame)
        assert decoder.sequences(frame)[0].text == text
    assert (frame.text_offset, frame.text) == (2, "XY")


def test_rebuilt_outputs_held_by_the_caller_never_change_and_dropped_ones_cost_no_copy() -> None:
    """The router's cumulative outputs share the decoder's lists, copied on write: an output still
    held keeps its tokens, logprobs and text while later frames arrive; once the caller dropped it,
    the next frame appends to the same lists (a frame is O(new tokens), not O(output so far))."""
    outputs = _cumulative(40, n=2, logprobs=True)
    encoder, decoder = FrameEncoder(), FrameDecoder()
    held = []
    for step, output in enumerate(outputs):
        frame = _wire(encoder.frame(output))
        decoder.check(frame)
        rebuilt = decoder.sequences(frame)
        if step % 3 == 0:
            held.append((step, rebuilt))
        del rebuilt
    for step, seqs in held:
        assert seqs == outputs[step].outputs, step
    decoder, encoder = FrameDecoder(), FrameEncoder()
    ids = []
    for output in outputs:
        frame = _wire(encoder.frame(output))
        decoder.check(frame)
        rebuilt = decoder.sequences(frame)
        assert rebuilt == output.outputs
        ids.append([(id(s.token_ids), id(s.logprobs)) for s in rebuilt])
        del rebuilt
    assert all(step_ids == ids[0] for step_ids in ids[1:])  # nothing held: the same lists, appended to


def _frames(num_tokens: int) -> list[OutputFrame]:
    encoder = FrameEncoder()
    return [_wire(encoder.frame(o)) for o in _cumulative(num_tokens)]


@pytest.mark.parametrize("order", [[0, 2], [1, 0], [0, 1, 1]])
def test_a_missed_or_reordered_frame_is_refused(order: list[int]) -> None:
    frames = _frames(4)
    decoder = FrameDecoder()
    with pytest.raises(FrameGap):
        for index in order:
            decoder.check(frames[index])
            decoder.sequences(frames[index])


def test_a_frame_after_tokens_not_received_is_refused() -> None:
    frames = _frames(3)
    decoder = FrameDecoder()
    decoder.check(frames[0])
    decoder.sequences(frames[0])
    skipped = frames[2].model_copy(update={"frame_no": 1})  # numbered as the next one, but a token missed
    decoder.check(skipped)
    with pytest.raises(FrameGap, match="after token 2"):
        decoder.sequences(skipped)


def test_the_router_ends_a_request_whose_stream_has_a_gap() -> None:
    """RequestRun._output_of: a gap is the request's error (decode_broke), not an output."""
    from pdserve.disagg.router.request_run import RequestRun

    frames = _frames(3)
    run = object.__new__(RequestRun)
    run.rid, run.prompt, run.early, run.frames_in = "r", [1, 2], None, FrameDecoder()
    first = asyncio.run(run._output_of(frames[0]))
    assert first is not None and first.outputs[0].token_ids == [0]
    with pytest.raises(RouterError) as raised:
        asyncio.run(run._output_of(frames[2]))
    assert raised.value.reason == "decode_broke"
