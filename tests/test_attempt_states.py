"""The lifecycles of a run (router), a reservation (decode) and an attempt (prefill): every move
the tables allow is made, every other one is refused loudly and changes nothing, every state can
be reached, and docs/ARCHITECTURE.md shows the tables as the code has them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.disagg.attempt_states import LIFECYCLES, IllegalTransition, Lifecycle, State

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


@pytest.mark.parametrize("lifecycle", LIFECYCLES, ids=lambda c: c.name)
def test_every_allowed_move_is_made_and_every_other_refused(lifecycle: Lifecycle,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    for old in lifecycle.moves:
        for new in lifecycle.moves:
            state = State(lifecycle, "r", old)
            if lifecycle.allows(old, new):
                state.move(new)
                assert state.now == new and state.history == [old, new]
                continue
            caplog.clear()
            with caplog.at_level(logging.ERROR), pytest.raises(IllegalTransition, match=f"{old} -> {new}"):
                state.move(new)
            assert state.now == old and state.history == [old]
            assert any(f"{old} -> {new} is not allowed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("lifecycle", LIFECYCLES, ids=lambda c: c.name)
def test_every_state_is_reachable_and_every_path_ends(lifecycle: Lifecycle) -> None:
    reached, frontier = {lifecycle.start}, [lifecycle.start]
    while frontier:
        for new in lifecycle.moves[frontier.pop()]:
            if new not in reached:
                reached.add(new)
                frontier.append(new)
    assert reached == set(lifecycle.moves)
    assert any(lifecycle.terminal(s) for s in lifecycle.moves)
    assert set(lifecycle.meaning) == set(lifecycle.moves)
    # every state can still end: a terminal state is reachable from each one
    for state in lifecycle.moves:
        seen, todo = {state}, [state]
        while todo and not any(lifecycle.terminal(s) for s in seen):
            for new in lifecycle.moves[todo.pop()]:
                if new not in seen:
                    seen.add(new)
                    todo.append(new)
        assert any(lifecycle.terminal(s) for s in seen), state


def test_a_state_it_does_not_have_is_refused() -> None:
    state = State(LIFECYCLES[0], "r")
    with pytest.raises(IllegalTransition, match="no state"):
        state.move("somewhere")


@pytest.mark.parametrize("lifecycle", LIFECYCLES, ids=lambda c: c.name)
def test_the_architecture_doc_shows_the_table(lifecycle: Lifecycle) -> None:
    assert lifecycle.markdown_table() in ARCHITECTURE.read_text()
