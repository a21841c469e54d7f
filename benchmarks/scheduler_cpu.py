"""The scheduler's CPU time per worker-iteration, in one process, without Redis or workers.

`iterserve bench experiments control-plane` measures the scheduler inside the running system, where
this 2-core machine's other processes (workers, Redis, the gateway) make every figure noisy. This
drives the same code in one process: the real policy, plan codec, output (detokenization, stop
strings, token entries) and the round trip's write packing (redis-py's command arguments,
hiredis's encoding, the token entries' msgpack), against a worker that answers from the worker's
own PlanReader (timed apart). Only the socket, reading the replies and Redis's own work are
missing, so it isolates what the scheduler's code costs per worker-iteration at a given batch,
phase by phase, as the service counts them.

    .venv/bin/python benchmarks/scheduler_cpu.py [--batch 64] [--workers 2] [--iterations 3000]
    .venv/bin/python benchmarks/scheduler_cpu.py --round-trips 2000
    .venv/bin/python benchmarks/scheduler_cpu.py --evict-caches 32
    .venv/bin/python benchmarks/scheduler_cpu.py --idle-ms 5 [--spin]

--evict-caches MB walks a buffer of MB megabytes after every worker-iteration, untimed: what the
other processes of a running system (workers, Redis, the gateway; on a shared host, other tenants)
do to the caches while the scheduler sleeps between results. Its data is read from memory again.

--idle-ms MS pauses MS milliseconds after every worker-iteration, untimed, with nothing else to
run: what the time between results costs by itself (inside the system a worker-iteration follows
the one before after the step time over the workers). It sleeps, or with --spin runs a loop that
touches almost no memory, to tell whether it is the idle core that costs or the time passing.

--schedulers N runs N of these at once, each a process alone on a CPU of its own and each one of
several schedulers (its round trips carry the lease fence: WATCH and GET, services/scheduler/shards.py),
then one alone the same way, and reports the worker-iterations per second of wall time they serve
together against the one: what N schedulers of a model serve on N cores, their workers' answers made
up. (Redis's own work per worker-iteration is not in it: docs/scaling.md gives that model.)

    .venv/bin/python benchmarks/scheduler_cpu.py --schedulers 2 [--batch 64] [--workers 2]

--round-trips times the one part left out, against a private redis-server: the round trip of a
worker-iteration's writes at batch 64 (its plan, 64 token entries, its iteration record, the
heartbeat) and the XREAD, sent by RedisLink.round_trip and, alternating with it, the same commands
through redis-py's pipeline (how the link sent them before): CPU time per round trip of each, and
the redis-server's own CPU time per round trip (the same commands either way: on the scheduler's
path, since the round trip waits for its replies).

Each worker keeps `pipeline_depth` plans in flight and a pool of 1.5x its batch, as the
control-plane experiment does (32-token prompts, 256 output tokens, greedy, no stop strings;
--stop [STRING] gives every request a stop string (by default one that never appears; " the" makes
most tokens search), --logprobs asks for 5 top log-probabilities). The workers write the token
entries of plain tokens, as they do by default (their side timed apart, with their codec);
--scheduler-token-entries has the scheduler write them all, as before.
"""

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import redis.asyncio  # noqa: E402

from services.bench.server import process_cpu_seconds  # noqa: E402
from services.launcher import free_port, wait_for_redis  # noqa: E402
from services.scheduler.held_results import ResultHolding  # noqa: E402
from services.scheduler.output import RequestOutputs  # noqa: E402
from services.scheduler.policy import SchedulerPolicy  # noqa: E402
from services.scheduler.redis_link import RedisLink  # noqa: E402
from services.worker.token_writer import TokenWriter  # noqa: E402
from shared import cache_digest, keys  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.messages import RequestRecord, SamplingParams  # noqa: E402
from services.worker.plan_reader import PlanReader, StepAnswers  # noqa: E402
from shared.plans import encode_plan, read_result, read_result_columns  # noqa: E402
from shared.redis_connection import connect  # noqa: E402
from shared.redis_exchange import encoded  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from shared.wire import encode_row  # noqa: E402

PHASES = ("plan", "encode", "decode", "apply", "fanout", "pack")
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 256


def token_for(seed: int, output_index: int) -> int:
    return 1000 + (seed * 7919 + output_index * 104729) % 20000  # ordinary word pieces, never a stop token


class Harness:
    def __init__(self, batch: int, workers: int, depth: int, stop: str | None, logprobs: bool,
                 worker_entries: bool = True, steps: int = 1, sharded: bool = False) -> None:
        self.tokenizer = Tokenizer.load()
        settings = Settings()  # the defaults `iterserve up` runs with (prefix caching, cache-aware placement)
        self.policy = SchedulerPolicy(
            "epoch", context_length=8192, stop_token_ids=self.tokenizer.stop_token_ids, max_batch_size=batch,
            pipeline_depth=depth, scheduler_steps=steps, max_batch_tokens=settings.max_batch_tokens, prefix_caching=settings.prefix_caching,
            placement=settings.placement, placement_slack=settings.placement_slack,
            placement_threshold=settings.placement_threshold, cache_salt=settings.model,
            text_context=self.tokenizer.text_context if worker_entries else None)
        # Its commands are built by a redis-py client that never connects.
        self.link = RedisLink(redis.asyncio.Redis(), on_write_failed=lambda write, error: None,
                              scheduler_id=keys.SHARDED_EPOCH_PREFIX + "bench" if sharded else "")
        self.outputs = RequestOutputs(self.tokenizer, self.policy, self.link, ResultHolding(False), 3600)
        self.worker_ids = [f"w{index}" for index in range(workers)]
        self.readers = {worker_id: PlanReader() for worker_id in self.worker_ids}
        self.token_writers = {worker_id: TokenWriter(self.tokenizer) for worker_id in self.worker_ids}
        self.kv_lengths: dict[str, int] = {}
        self.seeds: dict[str, int] = {}
        self.in_flight: dict[str, deque] = {worker_id: deque() for worker_id in self.worker_ids}
        self.stop, self.logprobs = stop, logprobs
        self.evict = None  # a buffer walked after every worker-iteration, untimed (--evict-caches)
        self.idle_seconds = 0.0  # paused after every worker-iteration, untimed (--idle-ms)
        self.spin = False  # the pause spins instead of sleeping (--spin)
        self.submitted = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.worker_seconds = 0.0  # the worker's side of the wire (PlanReader): reported apart
        self.iterations = 0
        self.batch_sum = 0
        self.cache_digests = dict.fromkeys(self.worker_ids, 0)  # each worker's prefix cache's, as it would report it
        for worker_id in self.worker_ids:
            self.policy.worker_up(worker_id, kv_blocks_total=4096, kv_block_size=16)
        self.active_target = int(batch * 1.5) * workers

    def submit(self) -> None:
        while self.policy.waiting_count + self.policy.running_count < self.active_target:
            seed = self.submitted
            request_id = f"{seed:032x}"
            prompt = tuple(token_for(seed, -1 - index) for index in range(PROMPT_TOKENS))
            sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, seed=seed, stop=(self.stop,) if self.stop else (),
                                      logprobs=5 if self.logprobs else -1)
            record = RequestRecord(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                   arrival_time=time.time())
            self.seeds[request_id] = seed
            state = self.policy.add_request(record)
            self.outputs.start(state.record, [], 0)
            self.submitted += 1

    def answer(self, worker_id: str, data: bytes) -> bytes:
        """The worker's side (not timed): decode the plan as a worker would and sample fake tokens;
        one answer for all its steps (--steps), as the worker's."""
        reader = self.readers[worker_id]
        started = time.process_time()
        kv_length = lambda request_id: self.kv_lengths.get(request_id, 0)  # noqa: E731
        decoded = reader.decode(data, kv_length, worker_id)
        self.cache_digests[worker_id] = cache_digest.after_plan(self.cache_digests[worker_id], decoded.plan)
        answers = StepAnswers(reader)
        self.worker_seconds += time.process_time() - started
        while decoded is not None:
            self._answer_step(worker_id, decoded, answers)
            started = time.process_time()
            decoded = reader.next_step(decoded, kv_length)
            self.worker_seconds += time.process_time() - started
        started = time.process_time()
        result = answers.packed(4096, 1000, 0, self.cache_digests[worker_id])
        self.worker_seconds += time.process_time() - started
        return msgpack.packb({"m": result})

    def _answer_step(self, worker_id: str, decoded, answers: StepAnswers) -> None:
        for request_id in decoded.plan.free_request_ids:
            self.kv_lengths.pop(request_id, None)
        tokens, logprobs = {}, {}
        for item in decoded.plan.items:
            self.kv_lengths[item.request_id] = item.start_position + (len(item.token_ids) or 1)
            if item.sample:
                tokens[item.request_id] = token_for(self.seeds[item.request_id], item.output_index)
                if self.logprobs:
                    logprobs[item.request_id] = (-0.5, tuple((token_for(index, 0), -1.0 - index) for index in range(5)))
        started = time.process_time()
        writer = self.token_writers[worker_id]
        writes, unwritten = writer.after_step(decoded.plan, tokens)
        if writes:
            writer.entries(writes)  # (written by the worker: its cost, not the scheduler's)
        answers.add(decoded, tokens, logprobs, [], 0.003, unwritten)
        self.worker_seconds += time.process_time() - started

    def run(self, iterations: int) -> None:
        clock = time.process_time
        while self.iterations < iterations:
            for worker_id in self.worker_ids:
                self.submit()
                while len(self.in_flight[worker_id]) < self.policy.depth(self.policy.worker(worker_id)):
                    started = clock()
                    plan = self.policy.next_plan(worker_id)
                    planned = clock()
                    self.seconds["plan"] += planned - started
                    if plan is None:
                        break
                    data = encode_plan(plan)
                    self.link.queue("xadd", keys.plan_stream(worker_id), {"m": data}, maxlen=1000, approximate=True)
                    for request_id in self.policy.joined(worker_id):
                        self.outputs.mark_running(request_id)
                    self.seconds["encode"] += clock() - planned
                    self.in_flight[worker_id].append(self.answer(worker_id, data))
                self.pack_writes()
                if not self.in_flight[worker_id]:
                    continue
                answer = msgpack.unpackb(self.in_flight[worker_id].popleft())["m"]  # (as XREAD's fields)
                started = clock()
                _, raw = read_result(answer)
                result = read_result_columns(raw)
                decoded = clock()
                self.seconds["decode"] += decoded - started
                answers = self.policy.answers_to_apply(result)  # (as the service: whole, or a step at a time)
                self.seconds["apply"] += clock() - decoded
                for result in answers:
                    started = clock()
                    outcomes = self.policy.on_result(result)
                    applied = clock()
                    self.seconds["apply"] += applied - started
                    self.outputs.publish_tokens(outcomes, worker_id)
                    self.outputs.publish_finished_without_token()
                    for record in self.policy.take_iteration_records():
                        self.batch_sum += len(record.request_ids)
                        self.iterations += 1
                        self.link.queue("xadd", self.link.keys.iterations, {"m": encode_row(record)}, maxlen=1000,
                                        approximate=False)
                    self.seconds["fanout"] += clock() - applied
                self.pack_writes()
                if self.evict is not None:
                    self.evict.sum()  # read it all, then dirty a word of every cache line
                    self.evict[::8] += 1.0
                if self.idle_seconds:
                    self.pause()

    def pause(self) -> None:
        """The time between two worker-iterations (--idle-ms), outside every timed phase."""
        if not self.spin:
            time.sleep(self.idle_seconds)
            return
        end = time.perf_counter() + self.idle_seconds
        while time.perf_counter() < end:
            pass

    def pack_writes(self) -> None:
        """What the round trip does with the queued writes before the socket (RedisLink.round_trip)."""
        started = time.process_time()
        _, _, arguments = self.link.commands(block_ms=50)
        encoded(arguments)
        self.link.writes.clear()
        self.link.tokens.drop(len(self.link.tokens))
        self.seconds["pack"] += time.process_time() - started


async def time_round_trips(url: str, count: int, batch: int, server_seconds) -> dict[str, float]:
    """CPU microseconds per round trip: RedisLink's own exchange, redis-py's pipeline, and the
    redis-server's own (server_seconds(): its CPU time so far) for the same commands."""
    client = connect(url)
    link = RedisLink(client, on_write_failed=lambda write, error: print("write failed:", write, error))
    await client.xadd(link.keys.results, {"m": b"r" * 650})  # every XREAD reads back one result
    payload = msgpack.packb([1, 2, "word"])
    seconds = {"link": 0.0, "redis-py pipeline": 0.0}
    server_started = server_seconds()
    for index in range(count):
        link.queue("xadd", keys.plan_stream("w0"), {"m": b"p" * 450}, maxlen=1000, approximate=True)
        for row in range(batch):
            link.queue_token(f"{row:032x}", keys.token_stream(f"{row:032x}"), f"0-{index + 1}", payload)
        link.queue("xadd", link.keys.iterations, {"m": b"i" * 2400}, maxlen=1000, approximate=False)
        link.queue("set", link.keys.scheduler_heartbeat, b"h" * 300, px=5000)
        link.read_ids = dict.fromkeys(link.read_ids, "0-0")
        started = time.process_time()
        if index % 100 < 50:
            entries = await link.round_trip(block_ms=None)
            seconds["link"] += time.process_time() - started
        else:  # as the link sent them before: redis-py's pipeline, replies through its callbacks
            writes, _, arguments = link.commands(block_ms=None)
            pipe = client.pipeline(transaction=False)
            for command_arguments in arguments:
                pipe.execute_command(*command_arguments)
            entries = (await pipe.execute(raise_on_error=False))[-1]
            del link.writes[: len(writes)]
            link.tokens.drop(len(link.tokens))
            seconds["redis-py pipeline"] += time.process_time() - started
        if not entries:
            raise RuntimeError("the round trip read nothing back")
    server = server_seconds() - server_started  # (both ways send the same commands)
    await client.flushdb()
    await client.aclose()
    return {**{way: 1e6 * total / (count / 2) for way, total in seconds.items()}, "redis-server": 1e6 * server / count}


def round_trips(count: int, batch: int) -> dict[str, float]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--round-trips needs redis-server (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_for_redis(url)
        try:
            from uvloop import run  # as the scheduler runs
        except ImportError:
            run = asyncio.run
        return run(time_round_trips(url, count, batch, lambda: process_cpu_seconds(process.pid)))
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--depth", type=int, default=2, help="plans in flight per worker (--pipeline-depth)")
    parser.add_argument("--steps", type=int, default=1, help="decode steps a plan runs (--scheduler-steps)")
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--stop", nargs="?", const="\u2603", default=None,
                        help="every request has this stop string (alone: one that never appears)")
    parser.add_argument("--logprobs", action="store_true", help="every request asks for 5 top log-probabilities")
    parser.add_argument("--round-trips", type=int, default=0, help="time this many Redis round trips instead")
    parser.add_argument("--evict-caches", type=float, default=0.0, metavar="MB",
                        help="walk a buffer of this many MB after every worker-iteration, untimed")
    parser.add_argument("--idle-ms", type=float, default=0.0, metavar="MS",
                        help="pause this many milliseconds after every worker-iteration, untimed")
    parser.add_argument("--spin", action="store_true", help="the --idle-ms pause spins instead of sleeping")
    parser.add_argument("--scheduler-token-entries", action="store_true",
                        help="the scheduler writes every token entry (as `iterserve up --scheduler-token-entries`)")
    parser.add_argument("--schedulers", type=int, default=0,
                        help="this many at once, each alone on a CPU, against one alone: worker-iterations per second")
    parser.add_argument("--sharded", action="store_true", help="one of several schedulers (the lease fence)")
    parser.add_argument("--cpu", type=int, default=-1, help="run on this CPU alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu >= 0:
        import os

        os.sched_setaffinity(0, {args.cpu})
    if args.schedulers:
        side_by_side(args)
        return
    if args.spin and not args.idle_ms:
        parser.error("--spin is how the --idle-ms pause is spent: give --idle-ms too")
    if args.round_trips:
        timings = round_trips(args.round_trips, args.batch)
        print(json.dumps(timings) if args.json else "CPU per round trip at batch {}: {}".format(
            args.batch, ", ".join(f"{way} {value:.0f} us" for way, value in timings.items())))
        return
    harness = Harness(args.batch, args.workers, args.depth, args.stop, args.logprobs,
                      worker_entries=not args.scheduler_token_entries, steps=args.steps, sharded=args.sharded)
    if args.evict_caches:
        harness.evict = np.ones(int(args.evict_caches * 2**20) // 8)
    harness.idle_seconds, harness.spin = args.idle_ms / 1000, args.spin
    harness.run(args.warmup)
    harness.seconds = dict.fromkeys(PHASES, 0.0)
    harness.worker_seconds = 0.0
    harness.iterations = harness.batch_sum = 0
    wall_started = time.perf_counter()
    harness.run(args.iterations)
    wall_seconds = time.perf_counter() - wall_started
    if harness.policy.prefix_cache_mismatches:  # the fake workers' digests are the plans' own: never
        raise SystemExit(f"{harness.policy.prefix_cache_mismatches} prefix-cache digest mismatches: the run is void")
    per_iteration = {phase: 1e6 * seconds / harness.iterations for phase, seconds in harness.seconds.items()}
    report = {"batch": harness.batch_sum / harness.iterations, "iterations": harness.iterations,
              "us_per_iteration": sum(per_iteration.values()), "phases_us": per_iteration,
              "worker_codec_us": 1e6 * harness.worker_seconds / harness.iterations,
              "scheduler_us_per_iteration_wall": 1e6 * (wall_seconds - harness.worker_seconds) / harness.iterations}
    if args.json:
        print(json.dumps(report))
        return
    print(f"mean batch {report['batch']:.1f} over {harness.iterations} worker-iterations: "
          f"{report['us_per_iteration']:.0f} us of scheduler CPU each")
    print("  " + "  ".join(f"{phase} {value:.0f}" for phase, value in per_iteration.items()))
    print(f"the worker's side (not the scheduler's): plan decode, result encode and token entries "
          f"{report['worker_codec_us']:.0f} us")


def side_by_side(args) -> None:
    """--schedulers N: N harnesses at once, each one of several schedulers alone on its CPU, then one
    alone the same way (alternating, twice each); each harness's rate counts its own code only (the made-up
    workers' side, timed, is taken out of its wall time)."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < args.schedulers:
        raise SystemExit(f"--schedulers {args.schedulers} needs as many CPUs; this process may use {cpus}")
    command = [sys.executable, __file__, "--json", "--sharded", "--batch", str(args.batch), "--workers",
               str(args.workers), "--iterations", str(args.iterations), "--warmup", str(args.warmup),
               "--depth", str(args.depth), "--steps", str(args.steps)]

    def rate(count: int) -> float:
        processes = [subprocess.Popen(command + ["--cpu", str(cpus[index])], stdout=subprocess.PIPE, text=True)
                     for index in range(count)]
        reports = [json.loads(process.communicate(timeout=600)[0]) for process in processes]
        return sum(1e6 / report["scheduler_us_per_iteration_wall"] for report in reports)

    rates: dict[int, list[float]] = {1: [], args.schedulers: []}
    for _ in range(2):
        for count in (args.schedulers, 1):
            rates[count].append(rate(count))
    one, several = max(rates[1]), max(rates[args.schedulers])
    print(f"worker-iterations per second at batch {args.batch} ({args.workers} made-up workers each), best of 2: "
          f"1 scheduler {one:.0f}, {args.schedulers} schedulers {several:.0f}: {several / one:.2f}x "
          f"(runs: {rates})")


if __name__ == "__main__":
    main()
