"""The worker process: holds the model and its KV cache, runs the plans addressed to it.

Loop: read the next BatchPlan from its Redis stream, free what the plan says, run the step
in the engine (in a thread, so heartbeats go on), publish the PlanResult. A heartbeat key
with a TTL announces it; when the key expires the scheduler moves its requests elsewhere.
"""

import asyncio
import logging
import os
import socket
import time
import uuid

import torch

from services.worker.engine import Engine
from shared import keys
from shared.config import Settings, threads_per_worker
from shared.messages import BatchPlan, PlanResult, SampledToken, WorkerInfo
from shared.redis_connection import RECONNECT_ERRORS, connect
from shared.wire import WireError, decode, encode

log = logging.getLogger("iterserve.worker")

PLAN_BLOCK_MS = 1000
PLANS_KEPT = 1000
RESULTS_KEPT = 10000


class Worker:
    def __init__(self, settings: Settings, engine: Engine, worker_id: str):
        self.settings, self.engine, self.worker_id = settings, engine, worker_id
        self.redis = connect(settings.redis_url)
        self.started_at = time.time()
        self.scheduler_epoch = ""
        self.draining = False
        self.device = str(engine.model.device)

    def info(self) -> WorkerInfo:
        kv = self.engine.kv_cache
        return WorkerInfo(
            worker_id=self.worker_id, pid=os.getpid(), host=socket.gethostname(), device=self.device,
            kv_block_size=kv.block_size, kv_blocks_total=kv.blocks_total, kv_blocks_free=kv.blocks_free,
            running=self.engine.running, draining=self.draining, started_at=self.started_at,
            heartbeat_at=time.time(),
        )

    async def heartbeat_forever(self) -> None:
        timeout_ms = int(self.settings.worker_timeout_seconds * 1000)
        while True:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.set(keys.worker_heartbeat(self.worker_id), encode(self.info()), px=timeout_ms)
                    pipe.sadd(keys.WORKERS_SET, self.worker_id)
                    await pipe.execute()
            except RECONNECT_ERRORS as error:
                log.warning("event=heartbeat_failed worker=%s error=%r", self.worker_id, error)
            await asyncio.sleep(self.settings.heartbeat_seconds)

    def execute(self, plan: BatchPlan) -> PlanResult:
        if plan.scheduler_epoch != self.scheduler_epoch:
            if self.scheduler_epoch:
                log.info("event=new_scheduler_epoch worker=%s dropping=%d", self.worker_id, self.engine.running)
            self.engine.reset()  # the new scheduler rebuilds every request from its tokens
            self.scheduler_epoch = plan.scheduler_epoch
        for request_id in plan.free_request_ids:
            self.engine.free(request_id)
        for new in plan.new_requests:
            self.engine.add_request(new.request_id, new.sampling)
        outcome = self.engine.step(plan.items)
        by_id = {item.request_id: item for item in plan.items}
        kv = self.engine.kv_cache
        return PlanResult(
            scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id, worker_id=self.worker_id,
            tokens=tuple(SampledToken(request_id=request_id, token_id=token, output_index=by_id[request_id].output_index)
                         for request_id, token in outcome.tokens.items()),
            errors=tuple(outcome.errors), kv_blocks_total=kv.blocks_total, kv_blocks_free=kv.blocks_free,
            step_seconds=outcome.seconds,
        )

    async def serve(self, stop_event: asyncio.Event) -> None:
        stream = keys.plan_stream(self.worker_id)
        last = await self.redis.xrevrange(stream, count=1)
        last_id = last[0][0] if last else b"0-0"
        heartbeat = asyncio.create_task(self.heartbeat_forever())
        log.info("event=worker_ready worker=%s pid=%d device=%s kv_blocks=%d threads=%d", self.worker_id,
                 os.getpid(), self.device, self.engine.kv_cache.blocks_total, torch.get_num_threads())
        try:
            while not stop_event.is_set():
                try:
                    replies = await self.redis.xread({stream: last_id}, count=1, block=PLAN_BLOCK_MS)
                except RECONNECT_ERRORS as error:
                    log.warning("event=redis_unavailable worker=%s error=%r", self.worker_id, error)
                    await asyncio.sleep(0.5)
                    continue
                for _, entries in replies:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        await self.handle(fields)
        finally:
            heartbeat.cancel()
            self.draining = True
            try:  # deregister at once rather than let the heartbeat expire; Redis may be gone
                async with asyncio.timeout(2):
                    await self.redis.delete(keys.worker_heartbeat(self.worker_id))
                    await self.redis.srem(keys.WORKERS_SET, self.worker_id)
            except (TimeoutError, *RECONNECT_ERRORS):
                pass
            await self.redis.aclose()

    async def handle(self, fields: dict) -> None:
        try:
            plan = decode(BatchPlan, fields.get(b"m", b""))
        except WireError as error:
            log.warning("event=bad_plan worker=%s error=%s", self.worker_id, error)
            return
        if plan.worker_id != self.worker_id:
            log.warning("event=misaddressed_plan worker=%s plan_worker=%s", self.worker_id, plan.worker_id)
            return
        result = await asyncio.to_thread(self.execute, plan)
        for error in result.errors:
            log.warning("event=item_error worker=%s request=%s code=%s message=%s", self.worker_id,
                        error.request_id, error.code, error.message)
        while True:
            try:
                await self.redis.xadd(keys.RESULTS_STREAM, {b"m": encode(result)}, maxlen=RESULTS_KEPT,
                                      approximate=True)
                return
            except RECONNECT_ERRORS as error:
                log.warning("event=publish_failed worker=%s plan=%d error=%r", self.worker_id, plan.plan_id, error)
                await asyncio.sleep(0.5)


def new_worker_id() -> str:
    return f"worker-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def run_worker(settings: Settings, stop_event: asyncio.Event | None = None) -> None:
    torch.set_num_threads(settings.threads or threads_per_worker(settings.workers))
    engine = await asyncio.to_thread(Engine.from_settings, settings)
    worker = Worker(settings, engine, settings.worker_id or new_worker_id())
    await worker.serve(stop_event or asyncio.Event())
    log.info("event=worker_stopped worker=%s", worker.worker_id)
