"""The engine alone: a workload's batches run back to back in one process (no Redis, no HTTP).

The same SchedulerPolicy the scheduler runs forms the batches (every request waiting at the
start, as at saturation), and services.worker.engine.Engine runs them; nothing else happens
between steps. This is the ceiling the whole system is measured against (experiment 2).

    python -m services.bench.engine_replay --spec '{"workload": {...}, "num_requests": 64, ...}' --output out.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

from services.bench.workloads import BenchRequest, PromptSource, WorkloadConfig, build_requests
from services.scheduler.policy import SchedulerPolicy
from shared.config import Settings, threads_per_worker
from shared.messages import RequestRecord, SamplingParams, StepItem
from shared.tokenizer import Tokenizer

WORKER_ID = "engine"


def prompt_ids(request: BenchRequest, tokenizer: Tokenizer) -> tuple[int, ...]:
    if request.endpoint == "chat":
        return tuple(tokenizer.encode_chat(list(request.messages)))
    return request.prompt


def replay(engine, requests: list[BenchRequest], tokenizer: Tokenizer, *, policy: str = "iteration",
           max_batch_size: int = 64, max_batch_tokens: int = 512, temperature: float = 0.0) -> dict:
    """Run every request to its end; returns throughput and per-iteration totals."""
    from services.bench.by_request_id import apply_result, plan_result  # what a worker answers, built the same way
    scheduler = SchedulerPolicy("replay", context_length=engine.config.context_length,
                                stop_token_ids=tokenizer.stop_token_ids, policy=policy,
                                max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens)
    scheduler.worker_up(WORKER_ID, engine.kv_cache.blocks_total, engine.kv_cache.block_size)
    for request in requests:
        sampling = SamplingParams(temperature=temperature, seed=request.seed, max_tokens=request.max_tokens,
                                  ignore_eos=True)
        scheduler.add_request(RequestRecord(request_id=f"r{request.index}", prompt_token_ids=prompt_ids(request, tokenizer),
                                            sampling=sampling, arrival_time=0.0))
    engine.reset()
    iterations = output_tokens = batch_items = 0
    step_seconds = scheduling_seconds = 0.0
    started = time.perf_counter()
    while True:
        planning = time.perf_counter()
        plan = scheduler.next_plan(WORKER_ID)
        scheduling_seconds += time.perf_counter() - planning
        if plan is None:
            break
        engine.take_plan(plan)
        outcome = engine.step(plan.items)
        step_seconds += outcome.seconds
        applying = time.perf_counter()
        result = plan_result(plan, outcome, WORKER_ID, engine.kv_cache)
        output_tokens += len(apply_result(scheduler, result))
        scheduler.take_finished_without_token()
        scheduler.take_iteration_records()
        scheduling_seconds += time.perf_counter() - applying
        if plan.items:
            iterations += 1
            batch_items += len(plan.items)
    wall = time.perf_counter() - started
    unfinished = scheduler.waiting_count + scheduler.running_count
    return {
        "requests": len(requests),
        "unfinished": unfinished,
        "iterations": iterations,
        "output_tokens": output_tokens,
        "mean_batch_size": batch_items / max(iterations, 1),
        "wall_s": wall,
        "step_s": step_seconds,
        "scheduling_s": scheduling_seconds,
        "mean_step_ms": 1000 * step_seconds / max(iterations, 1),
        "scheduling_ms_per_iteration": 1000 * scheduling_seconds / max(iterations, 1),
        "output_token_throughput_engine": output_tokens / max(step_seconds, 1e-9),
        "output_token_throughput_replay": output_tokens / max(wall, 1e-9),
        "request_throughput_replay": len(requests) / max(wall, 1e-9),
    }


def warm_up(engine, tokenizer: Tokenizer) -> None:
    """One short request first: the first steps pay for allocation and kernel selection."""
    engine.reset()
    engine.add_request("warm", SamplingParams(max_tokens=4, ignore_eos=True))
    ids = tokenizer.encode("The harbor town woke slowly on winter mornings.")
    token = engine.step([StepItem(request_id="warm", token_ids=tuple(ids), start_position=0, sample=True,
                                  output_index=0)]).tokens["warm"]
    for index in range(1, 4):
        token = engine.step([StepItem(request_id="warm", token_ids=(token,), start_position=len(ids) + index - 1,
                                      sample=True, output_index=index)]).tokens["warm"]
    engine.reset()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, help="JSON: workload, num_requests, seed, policy, kv_blocks, "
                                                      "threads, max_batch_size, max_batch_tokens, corpus")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    import torch

    from services.worker.engine import Engine

    workload = spec["workload"]
    workload = WorkloadConfig(**{**workload, "input_range": tuple(workload["input_range"]) if workload.get("input_range") else None,
                                 "output_range": tuple(workload["output_range"]) if workload.get("output_range") else None})
    settings = Settings.from_env(kv_blocks=spec["kv_blocks"], max_batch_size=spec.get("max_batch_size"),
                                 max_batch_tokens=spec.get("max_batch_tokens"))
    torch.set_num_threads(spec.get("threads") or threads_per_worker(1))
    tokenizer = Tokenizer.load(settings.model)
    kwargs = {"corpus": Path(spec["corpus"])} if spec.get("corpus") else {}
    requests = build_requests(workload, spec["num_requests"], spec["seed"], PromptSource(tokenizer, **kwargs))
    loading = time.perf_counter()
    engine = Engine.from_settings(settings)
    load_seconds = time.perf_counter() - loading
    warm_up(engine, tokenizer)
    result = replay(engine, requests, tokenizer, policy=spec.get("policy", "iteration"),
                    max_batch_size=settings.max_batch_size, max_batch_tokens=settings.max_batch_tokens,
                    temperature=workload.temperature)
    result.update(threads=torch.get_num_threads(), device=str(engine.model.device), dtype=str(engine.model.dtype),
                  load_s=load_seconds)
    with open(args.output, "w") as output:
        json.dump(result, output, indent=1)
    print(json.dumps(result), file=sys.stderr)


if __name__ == "__main__":
    main()
