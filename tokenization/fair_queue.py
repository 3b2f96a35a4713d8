"""A queue that serves its requesters in turn (sans-IO), so one requester's flood delays only itself.

Long prompts go to a few tokenizer worker processes. With one FIFO in front of them, a tenant within its
request rate could queue dozens of 8 MB prompts and every other tenant's prompt would wait behind all
of them. Here each requester has its own FIFO, bounded by ``per_requester``, and the requesters with work
waiting take turns: a requester's next job waits for at most one job of each other requester.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, per_requester: int) -> None:
        if per_requester < 1:
            raise ValueError("per_requester must be at least 1")
        self.per_requester = per_requester
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, requester: str, item: T) -> bool:
        """Queue ``item``; False (nothing queued) when the requester already has ``per_requester`` waiting."""
        queue = self._queues.get(requester)
        if queue is None:
            queue = self._queues[requester] = deque()
        elif len(queue) >= self.per_requester:
            return False
        queue.append(item)
        self._size += 1
        return True

    def pop(self) -> T | None:
        """The oldest item of the requester whose turn it is; that requester then goes to the back."""
        if not self._queues:
            return None
        requester, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        self._size -= 1
        if queue:
            self._queues.move_to_end(requester)
        else:
            del self._queues[requester]
        return item
