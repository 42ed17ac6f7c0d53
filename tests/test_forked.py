"""`autopar.forked.Forked`: a function's answer from a forked process, or from this one
where the child cannot give it (no fork, the child failed or died)."""

from __future__ import annotations

import os

import pytest

from autopar import forked
from autopar.forked import Forked


def test_the_answer_comes_from_a_forked_child() -> None:
    if not forked.can_fork():
        pytest.skip("this platform does not fork")
    here = os.getpid()
    assert Forked.start(os.getpid).result() != here


def test_a_child_started_nice_runs_at_that_lower_priority() -> None:
    """`nice=19` (the three-block check started ahead): the child runs on idle cycles;
    this process keeps its own priority."""
    if not forked.can_fork():
        pytest.skip("this platform does not fork")
    mine = os.nice(0)
    assert Forked.start(lambda: os.nice(0), nice=19).result() == min(19, mine + 19)
    assert Forked.start(lambda: os.nice(0)).result() == mine == os.nice(0)


def test_without_fork_the_function_runs_here_when_asked(monkeypatch) -> None:
    monkeypatch.setattr(forked, "can_fork", lambda: False)
    calls = []
    call = Forked.start(lambda: calls.append(1) or os.getpid())
    assert calls == []  # nothing ran yet: the work is done when the answer is asked for
    assert call.result() == os.getpid() and calls == [1]


def test_a_child_that_fails_leaves_the_work_to_this_process(tmp_path) -> None:
    """The child's error is not lost nor swallowed: the function runs again here, and its
    own error is raised with its traceback; an answer the child cannot send is computed
    here."""
    marker = tmp_path / "ran"

    def fails():
        marker.write_text(str(os.getpid()))
        raise ValueError("the function's own error")

    with pytest.raises(ValueError, match="the function's own error"):
        Forked.start(fails).result()
    assert marker.read_text() == str(os.getpid())  # the last run was this process's
    unpicklable = Forked.start(lambda: lambda: 1)  # a lambda does not pickle
    assert unpicklable.result()() == 1


def test_a_cancelled_child_is_stopped() -> None:
    if not forked.can_fork():
        pytest.skip("this platform does not fork")
    import time

    call = Forked.start(lambda: time.sleep(60))
    call.cancel()
    assert not call._process.is_alive()


def _spin(seconds: float) -> int:
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return os.getpid()


def test_a_recording_counts_the_cpu_of_the_answers_it_took() -> None:
    """A search's CPU seconds (`search.progress`, the bench's "cpu" line) include the work
    its `Forked` children did for it (a template's other trace, the three-block check)."""
    if not forked.can_fork():
        pytest.skip("this platform does not fork")
    from autopar.search import progress

    before = forked.children_cpu()
    with progress.recording() as rec:
        assert Forked.start(lambda: _spin(0.3)).result() != os.getpid()
    assert forked.children_cpu() - before >= 0.3
    assert rec.total_cpu >= 0.3  # this process only waited
