"""A tensor-parallel worker group: ranks holding shards of one model run every plan together.

`iterserve worker --tensor-parallel N` is rank 0: the worker the scheduler knows (its heartbeat,
its plans, its results), with the group's KV capacity. It starts ranks 1..N-1 as child processes
on torch.distributed (gloo on the CPU, NCCL on CUDA: each rank its own device) and hands every
change it makes to its engine to them too, in order, as a broadcast command (reset, take a
plan's frees and cache commands, step, free): each rank then holds the same rows and block
tables over its own shard of the KV, and a step's collectives (services/worker/tensor_parallel.py)
keep the ranks in lockstep; every rank samples the same token from the same gathered logits.

Faults: the death of any rank is the death of the group's worker. A rank that exits is seen by
rank 0 within MONITOR_SECONDS, and rank 0 exits at once (its heartbeat stops: the scheduler moves
its requests, token-exact, as for a killed worker); the other ranks die with their parent
(PR_SET_PDEATHSIG). The model's collectives time out after COLLECTIVE_TIMEOUT, so no rank hangs
in one; the command channel has no such timeout (an idle worker sends nothing for as long as
it likes), rank 0's death being signalled by the kernel instead.
"""

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from shared.config import Settings

log = logging.getLogger("iterserve.worker")

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
COMMAND_TIMEOUT = timedelta(days=7)  # the command channel: idle for as long as the worker is
MONITOR_SECONDS = 0.2
START_TIMEOUT_SECONDS = 600  # loading a shard of a large model
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


def _join(rank: int, world: int, address: str, device: str) -> "dist.ProcessGroup":
    """Join the group; returns the command channel (the default group carries the model's collectives)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


def _follower(rank: int, world: int, address: str, settings_json: str) -> None:
    """Ranks 1..N-1: load the shard, then do what rank 0 did, command by command, for as long as rank 0
    lives (they die with it)."""
    from services.worker.engine import Engine
    from services.worker.kv_cache import CacheMismatch
    from shared.config import Settings

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    settings = Settings.model_validate_json(settings_json)
    logging.basicConfig(level=settings.log_level, format=f"%(asctime)s %(levelname)s iterserve.rank{rank} %(message)s")
    torch.set_num_threads(max(1, settings.threads))
    channel = _join(rank, world, address, settings.device)
    engine = Engine.from_settings(settings)
    box: list[Any] = [None]
    while True:
        dist.broadcast_object_list(box, src=0, group=channel)
        name, *arguments = box[0]
        try:
            getattr(engine, name)(*arguments)
        except CacheMismatch:
            pass  # rank 0 meets the same refusal and resets: its next command says so


class EngineGroup:
    """Rank 0's engine as the worker service uses it: every change also goes to the other ranks."""

    executor = "engine"

    def __init__(self, engine, channel: "dist.ProcessGroup", followers: list[multiprocessing.Process]):
        self.engine, self.channel, self.followers = engine, channel, followers
        self.world = len(followers) + 1
        self.device_name = f"{engine.device_name} x{self.world} (tensor parallel)"
        self._monitor = threading.Thread(target=self._watch, name="group-monitor", daemon=True)
        self._monitor.start()

    def __getattr__(self, name: str) -> Any:  # reads: rank 0's engine answers for the group
        return getattr(self.engine, name)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.engine.kv_bytes_per_token * self.world

    def _send(self, *command: Any) -> None:
        dist.broadcast_object_list([command], src=0, group=self.channel)

    def _together(self, name: str, *arguments: Any) -> Any:
        """The command on every rank; a collective that fails because a rank died says so."""
        try:
            self._send(name, *arguments)
            return getattr(self.engine, name)(*arguments)
        except Exception:
            self._stop_if_a_rank_died(MONITOR_SECONDS * 5)
            raise

    def reset(self) -> None:
        self._together("reset")

    def take_plan(self, plan) -> None:
        self._together("take_plan", plan)

    def step(self, items, return_logits: bool = False):
        self._send("step", items)
        try:
            return self.engine.step(items, return_logits)
        except Exception:
            self._stop_if_a_rank_died(MONITOR_SECONDS * 5)
            raise

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
    """Start ranks 1..N-1, join them as rank 0, load this rank's shard."""
    from services.worker.engine import Engine

    from services.worker.tensor_parallel import check_divisible
    from shared.config import threads_per_worker
    from shared.model_file import load_metadata

    world = settings.tensor_parallel
    try:
        check_divisible(load_metadata(settings.model).config, world)  # before any rank starts
    except ValueError as error:
        raise SystemExit(f"iterserve worker: {error}") from None
    settings = settings.model_copy(update={"threads": settings.threads or threads_per_worker(settings.workers * world)})
    if settings.kv_memory_fraction > 0:  # every rank must hold the same number of blocks: rank 0's count
        settings = settings.model_copy(update={"kv_blocks": Engine.blocks_for_settings(settings, world),
                                               "kv_memory_fraction": 0.0})
    address = f"127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")
    followers = [context.Process(target=_follower, name=f"rank{rank}", daemon=True,
                                 args=(rank, world, address, _rank_settings(settings, rank).model_dump_json()))
                 for rank in range(1, world)]
    for follower in followers:
        follower.start()
    rank_settings = _rank_settings(settings, 0)
    channel = _join(0, world, address, rank_settings.device)
    engine = Engine.from_settings(rank_settings)
    log.info("event=group_ready world=%d backend=%s", world, dist.get_backend())
    return EngineGroup(engine, channel, followers)
