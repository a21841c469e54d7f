"""Orca's request-level baseline (`--policy request --request-results batch`): a request's results
return when its whole batch is done, as FasterTransformer served them (Orca, section 2.2).

While a request's batch runs on a worker, the writes of its token events and of its end wait here;
when nothing runs on that worker any more (all finished, or the worker went down), they are
released, in the order they were produced. A cancel releases the request's writes at once (its
cancelled entry then follows them). A scheduler restart loses only writes still held, which the
rebuilt requests compute again. With the iteration policy nothing is ever held.
"""

from dataclasses import dataclass, field

from services.scheduler.policy import SchedulerPolicy
from services.scheduler.redis_link import Write


@dataclass(eq=False)
class HeldResults:
    """A request's writes not made yet: its request-level batch still runs."""

    worker_id: str
    writes: list[Write] = field(default_factory=list)


class ResultHolding:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._held: dict[str, HeldResults] = {}  # request id -> its writes held until its batch ends

    def hold(self, request_id: str, worker_id: str) -> None:
        """Hold the request's writes until the batch it runs in on this worker is done."""
        if not self.enabled:
            return
        held = self._held.setdefault(request_id, HeldResults(worker_id))
        held.worker_id = worker_id  # moved (rebuilt elsewhere): its earlier writes wait with it

    def keep(self, write: Write) -> bool:
        """True when the write belongs to a held request (it waits here); False: send it now."""
        if not self.enabled:
            return False  # (every token's write asks: the iteration policy holds nothing)
        held = self._held.get(write.request_id) if write.request_id else None
        if held is None:
            return False
        held.writes.append(write)
        return True

    def release(self, request_id: str) -> list[Write]:
        held = self._held.pop(request_id, None)
        return held.writes if held is not None else []

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def release_finished_batches(self, policy: SchedulerPolicy) -> list[Write]:
        """The held writes of every worker whose batch is done (nothing running: all finished, or it
        went down), in the order they were produced."""
        released = []
        for request_id, held in list(self._held.items()):
            worker = policy.worker(held.worker_id)
            if worker is None or not worker.running:
                released.extend(self.release(request_id))
        return released
