"""One worker's running requests, by row: their handles on the wire and their FCFS order.

A request admitted to a worker takes a row there and keeps it while it runs on that worker; the
row is its handle in that worker's plans (shared/plans.py), so a plan names a request by a small
integer the scheduler already holds (no map from ids to handles per item), and a result's tokens
come back by row. A released row is free for a request admitted from the next plan on, which
frees it on the worker first (a plan's frees come before its new requests). A plan in flight holds
its items' requests themselves, not their rows, and notes those that leave the worker before it is
answered (PlanInFlight.left): an answer to a plan sent before a row changed hands applies nothing
to the row's new request.

The running requests are also kept here in FCFS order (arrival time, then arrival order) as they
come and go, so planning a step walks them in that order without sorting them at every step.
"""

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.request_state import RequestState

MAX_ROWS = 65536  # handles are uint16 on the wire


class RunningRows:
    def __init__(self) -> None:
        self.states: list["RequestState | None"] = []  # row -> the request holding it
        self._free: list[int] = []  # rows released, the lowest last (taken first)
        self.order: list["RequestState"] = []  # the running requests, oldest first
        self._order_keys: list[tuple[float, int]] = []  # their fcfs_keys (for bisect)

    def __len__(self) -> int:
        return len(self.order)

    def add(self, state: "RequestState") -> int:
        """Give an admitted request a row (state.row)."""
        if self._free:
            row = self._free.pop()
            self.states[row] = state
        else:
            row = len(self.states)
            if row >= MAX_ROWS:
                raise ValueError(f"more than {MAX_ROWS} requests on one worker")
            self.states.append(state)
        state.row = row
        position = bisect.bisect(self._order_keys, state.fcfs_key)
        self._order_keys.insert(position, state.fcfs_key)
        self.order.insert(position, state)
        return row

    def release(self, state: "RequestState") -> int:
        """Free the request's row; returns it."""
        row = state.row
        position = bisect.bisect_left(self._order_keys, state.fcfs_key)
        while self.order[position] is not state:  # (an equal key cannot happen: arrival orders differ)
            position += 1
        del self._order_keys[position], self.order[position]
        self.states[row] = None
        bisect.insort(self._free, row, key=lambda free: -free)  # (the lowest row is taken next)
        state.row = -1
        return row
