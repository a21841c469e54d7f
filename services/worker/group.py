"""A worker group: ranks holding shares of one model run every plan together.

`iterserve worker --tensor-parallel N --pipeline-parallel M` is rank 0: the worker the scheduler
knows (its heartbeat, its plans, its results), with the group's KV capacity. It starts ranks
1..NM-1 as child processes on torch.distributed (gloo on the CPU, NCCL on CUDA: each rank its own
device) and hands every change it makes to its engine to them too, in order, as a command on each
rank's queue (reset, take a plan's frees and cache commands, step, free, take sampled tokens):
each rank then holds the same rows and block tables over its own share of the KV, and a step's
collectives and stage-to-stage sends (services/worker/parallel.py) carry its data.

With one stage every rank samples the same token from the same full logits, in lockstep. With M
stages the stages overlap (Orca's figure 8): rank 0 runs the first stage of a step and goes on to
the next plan's (`launch`) while the later stages work on this one; the last stage samples and
sends the tokens back, and rank 0 takes them (`finish`) and answers the plan. The scheduler keeps
M plans in flight for such a worker, with disjoint requests (a request's next token needs the
last one); a plan that does feed a token still on its way waits for it (services/worker/service.py).

Faults: the death of any rank is the death of the group's worker. A rank that exits is seen by
rank 0 within MONITOR_SECONDS, and rank 0 exits at once (its heartbeat stops: the scheduler moves
its requests, token-exact, as for a killed worker); the other ranks die with their parent
(PR_SET_PDEATHSIG). The model's collectives time out after COLLECTIVE_TIMEOUT, so no rank hangs
in one; the command queues have no such timeout (an idle worker sends nothing for as long as it
likes), rank 0's death being signalled by the kernel instead.
"""

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from services.worker.parallel import Layout
    from shared.config import Settings

log = logging.getLogger("iterserve.worker")

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
MONITOR_SECONDS = 0.2
DYING_RANK_SECONDS = 5.0  # how long a rank whose sockets closed may take to be seen gone
PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_settings(settings: "Settings", rank: int) -> "Settings":
    device = settings.device
    if torch.cuda.is_available() and device in ("auto", "cuda"):
        device = f"cuda:{rank % torch.cuda.device_count()}"
    return settings.model_copy(update={"device": device})


def _join(rank: int, layout: "Layout", address: str, device: str) -> None:
    """Join the group (the default group and the stages' groups carry the model's collectives)."""
    from services.worker.parallel import make_tensor_groups

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=layout.world,
                            timeout=COLLECTIVE_TIMEOUT)
    make_tensor_groups(layout)


def _follower(rank: int, address: str, settings_json: str, commands: "multiprocessing.Queue") -> None:
    """Ranks 1..NM-1: load the shard, then do what rank 0 did, command by command, for as long as rank 0
    lives (they die with it)."""
    from services.worker.engine import Engine
    from services.worker.kv_cache import CacheMismatch
    from services.worker.parallel import Layout
    from shared.config import Settings
    from shared.startup_heap import freeze_startup_heap

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    settings = Settings.model_validate_json(settings_json)
    logging.basicConfig(level=settings.log_level, format=f"%(asctime)s %(levelname)s iterserve.rank{rank} %(message)s")
    torch.set_num_threads(max(1, settings.threads))
    layout = Layout(settings.tensor_parallel, settings.pipeline_parallel)
    _join(rank, layout, address, settings.device)
    engine = Engine.from_settings(settings)
    engine.defer_sampled = layout.pipeline > 1
    freeze_startup_heap(f"rank{rank}")
    while True:
        name, *arguments = commands.get()
        try:
            getattr(engine, name)(*arguments)
        except CacheMismatch:
            pass  # rank 0 meets the same refusal and resets: its next command says so


class EngineGroup:
    """Rank 0's engine as the worker service uses it: every change also goes to the other ranks."""

    executor = "engine"

    def __init__(self, engine, commands: list["multiprocessing.Queue"], followers: list[multiprocessing.Process],
                 layout: "Layout"):
        self.engine, self.commands, self.followers, self.layout = engine, commands, followers, layout
        self.stages = layout.pipeline  # plans it runs at once, one per stage
        engine.defer_sampled = layout.pipeline > 1
        self.device_name = f"{engine.device_name} x{layout.world} ({layout.describe()})"
        self._monitor = threading.Thread(target=self._watch, name="group-monitor", daemon=True)
        self._monitor.start()

    def __getattr__(self, name: str) -> Any:  # reads: rank 0's engine answers for the group
        return getattr(self.engine, name)

    @property
    def kv_bytes_per_token(self) -> int:
        from services.worker.parallel import kv_bytes_per_token

        element_size = self.engine.kv_cache.keys[0].element_size()
        return kv_bytes_per_token(self.engine.model.full_config, self.layout, element_size)

    def _send(self, *command: Any) -> None:
        for queue in self.commands:
            queue.put(command)

    def _together(self, name: str, *arguments: Any) -> Any:
        """The command on every rank."""
        with self._a_dead_rank_stops_the_group():
            self._send(name, *arguments)
            return getattr(self.engine, name)(*arguments)

    @contextlib.contextmanager
    def _a_dead_rank_stops_the_group(self) -> Iterator[None]:
        """A collective that fails because a rank died stops the group (else the error goes on). The
        collective fails as the dead rank's sockets close, which may be well before its process is
        seen gone: a large process killed on a loaded host took over a second (CI), so up to
        DYING_RANK_SECONDS are given (a collective that fails for another reason is fatal anyway)."""
        try:
            yield
        except Exception:
            self._stop_if_a_rank_died(DYING_RANK_SECONDS)
            raise

    def reset(self) -> None:
        self._together("reset")

    def take_plan(self, plan) -> None:
        self._together("take_plan", plan)

    def step(self, items):
        """One stage: the whole step. Several: its first stage only (the tokens come with finish)."""
        return self._together("step", items)

    def finish(self, outcome):
        """Several stages: the oldest step's tokens from the last stage, into its outcome (every
        earlier rank notes them too)."""
        with self._a_dead_rank_stops_the_group():
            self._send("take_sampled")  # (the other ranks' outcomes go nowhere)
            return self.engine.take_sampled(outcome)

    def free(self, request_id: str) -> None:
        self._together("free", request_id)

    def _stop_if_a_rank_died(self, within: float = 0.0) -> None:
        """Any rank gone is the group gone: exit at once, as a killed worker (the scheduler moves its
        requests when its heartbeat stops; the other ranks die with this process). `within`: how
        long a rank that is dying may take to be seen gone (a collective fails as its peer closes)."""
        deadline = time.monotonic() + within
        while True:
            for rank, follower in enumerate(self.followers, start=1):
                if not follower.is_alive():
                    from services.worker.service import ENGINE_BROKEN_EXIT_CODE

                    log.error("event=group_rank_died rank=%d exitcode=%s: the worker group stops", rank,
                              follower.exitcode)
                    logging.shutdown()
                    os._exit(ENGINE_BROKEN_EXIT_CODE)
            if time.monotonic() >= deadline:
                return
            time.sleep(MONITOR_SECONDS / 4)

    def _watch(self) -> None:
        while True:
            self._stop_if_a_rank_died()
            time.sleep(MONITOR_SECONDS)


def start_group(settings: "Settings") -> EngineGroup:
    """Start ranks 1..NM-1, join them as rank 0, load this rank's share."""
    from services.worker.engine import Engine
    from services.worker.parallel import Layout, check_split
    from shared.config import threads_per_worker
    from shared.model_file import load_metadata

    layout = Layout(settings.tensor_parallel, settings.pipeline_parallel)
    try:
        check_split(load_metadata(settings.model).config, layout)  # before any rank starts
    except ValueError as error:
        from shared.exits import configuration_error

        raise configuration_error(f"iterserve worker: {error}") from None
    threads = settings.threads or threads_per_worker(settings.workers * layout.world)
    settings = settings.model_copy(update={"threads": threads})
    if settings.cuda_graphs:  # a captured step would replay without its collectives and sends
        log.warning("event=cuda_graphs_ignored reason=worker_group")
        settings = settings.model_copy(update={"cuda_graphs": False})
    if settings.compile:  # the ranks' forward passes (collectives, sends between stages) run eager
        log.warning("event=compile_ignored reason=worker_group")
        settings = settings.model_copy(update={"compile": False})
    if settings.kv_memory_fraction > 0:  # every rank must hold the same number of blocks: rank 0's count
        settings = settings.model_copy(update={"kv_blocks": Engine.blocks_for_settings(settings),
                                               "kv_memory_fraction": 0.0})
    address = f"127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")
    commands = [context.Queue() for _ in range(1, layout.world)]
    followers = [context.Process(target=_follower, name=f"rank{rank}", daemon=True,
                                 args=(rank, address, _rank_settings(settings, rank).model_dump_json(),
                                       commands[rank - 1]))
                 for rank in range(1, layout.world)]
    for follower in followers:
        follower.start()
    rank_settings = _rank_settings(settings, 0)
    _join(0, layout, address, rank_settings.device)
    engine = Engine.from_settings(rank_settings)
    log.info("event=group_ready world=%d layout=%r backend=%s", layout.world, layout.describe(), dist.get_backend())
    return EngineGroup(engine, commands, followers, layout)
