"""`iterserve up --schedulers 2` as a user runs it: two schedulers of the model, each leasing one of
the two workers, shown in /status and /metrics; one SIGKILLed, the other takes its worker, `up`
starts it again, it joins again and is handed a worker back; a stop leaves no process behind. (The faults with real workers
mid-stream, output against output, are tests/test_chaos.py's two-scheduler scenarios.)"""

import json
import time
import urllib.request

import psutil
import pytest

from tests.system import System

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def status(system: System) -> dict:
    with urllib.request.urlopen(f"{system.base_url}/status", timeout=10) as response:
        return json.loads(response.read())


def schedulers(system: System) -> list[dict]:
    return next(iter(status(system)["models"].values()))["schedulers"]


def until(condition, what: str, system: System, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{system.log()[-3000:]}"
        time.sleep(0.2)


def completion(system: System, prompt: str) -> str:
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{system.base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["text"]


def scheduler_processes(system: System) -> list[psutil.Process]:
    return [process for process in system.descendants() if "scheduler" in process.cmdline()[-1:]]


def test_up_with_two_schedulers_shares_the_workers_and_one_killed_is_taken_over_and_joins_again():
    prompts = [f"{index}. Tell me about the sea." for index in range(6)]
    with System("--schedulers", "2", workers=2) as system:
        until(lambda: [len(scheduler["leases"]) for scheduler in schedulers(system)] == [1, 1],
              "a worker leased by each scheduler", system)
        expected = [completion(system, prompt) for prompt in prompts]
        metrics = urllib.request.urlopen(f"{system.base_url}/metrics", timeout=10).read().decode()
        assert metrics.count("iterserve_scheduler_leased_workers{") == 2, metrics
        processes = scheduler_processes(system)
        assert len(processes) == 2
        killed = processes[0]
        killed_id = next(scheduler["scheduler_id"] for scheduler in schedulers(system)
                         if scheduler["pid"] == killed.pid)
        killed.kill()
        until(lambda: any(len(scheduler["leases"]) == 2 for scheduler in schedulers(system)),
              "the other scheduler holding both workers", system, timeout=30)
        assert [completion(system, prompt) for prompt in prompts] == expected  # greedy: the same text
        until(lambda: len(schedulers(system)) == 2 and killed_id not in
              [scheduler["scheduler_id"] for scheduler in schedulers(system)],
              "the restarted scheduler joining again", system)
        assert "scheduler_taken_over" in system.log()
        # holding two workers to the other's none, the survivor hands one over (drained first)
        until(lambda: [len(scheduler["leases"]) for scheduler in schedulers(system)] == [1, 1],
              "a worker handed over to the restarted scheduler", system, timeout=30)
        assert "worker_handed_over" in system.log()
        assert [completion(system, prompt) for prompt in prompts] == expected
        assert not system.stop(), "`up` left processes behind"
