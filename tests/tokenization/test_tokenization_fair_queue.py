"""The tokenizer workers' queue: requesters take turns, each bounded; late and abandoned jobs never run."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tokenization.fair_queue import FairQueue
from tokenization.worker import REQUESTER, TokenizerBusy, WorkerPool

pushes = st.lists(st.tuples(st.sampled_from("abcd"), st.booleans()), max_size=200)


@given(pushes, st.integers(1, 5))
def test_requesters_take_turns_in_fifo_order_within_their_bound(ops, bound):
    """``ops``: (requester, pop after this push?). Each requester's items leave in the order they came;
    while a requester has items waiting, every other requester is served at most once between two of its
    items; no requester ever has more than ``bound`` waiting."""
    queue: FairQueue[tuple[str, int]] = FairQueue(bound)
    waiting: dict[str, list[int]] = {}
    passed_over: dict[str, int] = {}
    """Per requester with items waiting: how many others were served since it last was."""
    for n, (requester, pop) in enumerate(ops):
        accepted = queue.push(requester, (requester, n))
        assert accepted == (len(waiting.get(requester, [])) < bound)
        if accepted:
            waiting.setdefault(requester, []).append(n)
            passed_over.setdefault(requester, 0)
        if pop:
            item = queue.pop()
            assert item is not None
            owner, number = item
            assert waiting[owner].pop(0) == number
            for other in passed_over:
                passed_over[other] = 0 if other == owner else passed_over[other] + 1
            assert max(passed_over.values()) <= 3  # at most one turn of each other requester
            if not waiting[owner]:
                del passed_over[owner]
        assert len(queue) == sum(map(len, waiting.values()))
    while (item := queue.pop()) is not None:
        assert waiting[item[0]].pop(0) == item[1]
    assert not any(waiting.values())


def test_a_flooding_requester_delays_another_by_one_item():
    queue: FairQueue[str] = FairQueue(8)
    for i in range(8):
        assert queue.push("flood", f"f{i}")
    assert not queue.push("flood", "f8")
    assert queue.pop() == "f0"
    queue.push("polite", "p0")
    assert [queue.pop(), queue.pop()] == ["f1", "p0"]


async def test_a_job_that_waited_past_its_deadline_is_refused_not_run(autojump_clock):
    pool = WorkerPool(["unused"], deadline_s=5.0)
    outcome: list[BaseException] = []

    async def ask() -> None:
        REQUESTER.set("slow-tenant")
        try:
            await pool.encode("unused", ["text"])
        except TokenizerBusy as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.sleep(6.0)
        assert pool._next_job() is None
    assert len(outcome) == 1 and not outcome[0].own_load and pool.dropped["expired"] == 1


async def test_a_job_whose_caller_left_is_dropped_and_a_full_queue_refuses_at_once(autojump_clock):
    pool = WorkerPool(["unused"], per_requester=1)
    with trio.move_on_after(1.0):
        await pool.encode("unused", ["gone"])
    with pytest.raises(TokenizerBusy) as refused:
        await pool.encode("unused", ["too many"])
    assert refused.value.own_load and pool.dropped["refused"] == 1
    assert pool._next_job() is None and pool.dropped["abandoned"] == 1
