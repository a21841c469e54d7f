"""The live page, rendered by headless Chromium against `iterserve up` with traffic: every worker
(named as /status names it) with its timeline of iterations, the waiting queue, latencies, and a
cancelled request shown as cancelled."""

import asyncio
import json
import os
import re
import shutil
import urllib.request

import aiohttp
import pytest

from tests.browser import Browser, chromium_binary
from tests.system import System

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


async def test_the_dashboard_shows_every_worker_its_iterations_and_a_cancelled_request(tmp_path):
    """... and a worker of an earlier run, whose iteration records Redis kept (it keeps its data across
    runs), marked gone after the live ones; and latencies that say there are none yet."""
    import redis

    from shared import keys
    from shared.messages import IterationRecord
    from shared.wire import encode

    chromium_binary()  # skip (or fail in CI) before starting anything
    with System(workers=2) as system:
        for _ in range(240):  # healthy is one worker: wait for both
            if len(get_json(f"{system.base_url}/status")["workers"]) == 2:
                break
            await asyncio.sleep(0.25)
        earlier = "worker-of-an-earlier-run"
        client = redis.Redis.from_url(system.redis_url)
        try:
            client.xadd(keys.ITERATIONS_STREAM, {"m": encode(IterationRecord(
                iteration=1, worker_id=earlier, plan_id=1, request_ids=("cmpl-old",), joined=("cmpl-old",),
                finished=(), prefill_tokens=12, decode_tokens=0, started_at=1.0, finished_at=1.1))})
        finally:
            client.close()
        async with Browser() as browser, aiohttp.ClientSession() as http:
            await browser.open(f"{system.base_url}/dashboard")
            await browser.wait_for("document.getElementById('waiting').textContent !== '–'", what="the queue")
            gone = f"section.worker.gone[data-worker-id=\"{earlier}\"]"
            await browser.wait_for(f"!!document.querySelector('{gone}')", what="the earlier run's worker marked gone")
            assert "gone" in await browser.evaluate(f"document.querySelector('{gone} .info').textContent")
            assert await browser.evaluate("document.querySelector('#workers section:last-child').dataset.workerId") \
                == earlier, "a gone worker comes after the live ones"
            await browser.wait_for("document.getElementById('ttft').textContent === 'no first token yet'",
                                   what="the latencies saying there are none yet")

            async def complete(prompt: str, max_tokens: int) -> dict:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                async with http.post(f"{system.base_url}/v1/completions", json=body) as response:
                    return await response.json()

            traffic = [asyncio.create_task(complete(f"Story number {index}: once upon a time", 24))
                       for index in range(6)]
            long_body = {"model": MODEL, "prompt": "Count slowly to a thousand:", "max_tokens": 400,
                         "temperature": 0, "stream": True, "ignore_eos": True}
            async with http.post(f"{system.base_url}/v1/completions", json=long_body) as stream:
                request_id = stream.headers["X-Request-Id"]
                for _ in range(8):  # some tokens out: it is running, in its worker's batches
                    await stream.content.readuntil(b"\n\n")
                async with http.delete(f"{system.base_url}/v1/requests/{request_id}") as cancel:
                    assert (await cancel.json())["cancelled"] is True
            # More iterations after the cancel: a cancel is in the record of its worker's next iteration
            # when the latest one was already written.
            traffic += [asyncio.create_task(complete(f"Afterwards {index}:", 8)) for index in range(4)]
            await asyncio.gather(*traffic)

            workers = [worker["id"] for worker in get_json(f"{system.base_url}/status")["workers"]]
            assert len(workers) == 2
            for worker_id in workers:
                bars = await browser.wait_for(
                    f"document.querySelectorAll('section.worker[data-worker-id=\"{worker_id}\"] .iteration').length",
                    what=f"iterations of {worker_id}")
                assert bars > 0
                heading = await browser.evaluate(
                    f"document.querySelector('section.worker[data-worker-id=\"{worker_id}\"] h2').textContent")
                assert heading == worker_id
            listed = f"#events li.cancelled[data-request-id=\"{request_id}\"]"
            await browser.wait_for(f"!!document.querySelector('{listed}')", what=f"the cancelled request {request_id}")
            batch = await browser.evaluate("document.querySelector('.iteration.with-cancel') !== null")
            assert batch, "the batch the cancelled request was in is marked"
            await browser.wait_for("/ (ms|s)$/.test(document.getElementById('ttft').textContent)",
                                   what="time to first token")
            info = await browser.evaluate("document.querySelector('section.worker .info').textContent")
            assert f"model {MODEL}" in info and "KV" in info
            assert await browser.evaluate("document.getElementById('problem').textContent") == ""
            assert get_json(f"{system.base_url}/status")["models"][MODEL]["speculative"] is None
            assert await browser.evaluate("getComputedStyle(document.getElementById('speculation-card')).display") \
                == "none", "no speculation card for a model that does not speculate"
            screenshot = tmp_path / "dashboard.png"
            await browser.screenshot(screenshot)
            assert screenshot.stat().st_size > 10_000
            if os.environ.get("ITERSERVE_DASHBOARD_SCREENSHOT"):  # to refresh the README's picture
                shutil.copy(screenshot, os.environ["ITERSERVE_DASHBOARD_SCREENSHOT"])


SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
QUOTE = ("The harbor town woke slowly on winter mornings. Before the sun cleared the hills, the fishing boats "
         "were already back at the pier, their decks crowded with crates of silver mackerel.")


def metric(text: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


async def test_the_dashboard_shows_a_speculating_models_acceptance_as_status_and_metrics_count_it(tmp_path):
    """Item 5 of speculative decoding: per model, the proposals kept, vLLM's mean acceptance length and
    the per-request histogram, on /status and drawn on the page, equal to /metrics' counters."""
    chromium_binary()
    with System("--speculative-config", SPECULATIVE, workers=1) as system:
        async with aiohttp.ClientSession() as http:
            async def chat(content: str) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 40,
                        "temperature": 0}
                async with http.post(f"{system.base_url}/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()

            for content in (f"Copy this text exactly:\n\n{QUOTE}", f"Repeat after me: {QUOTE}"):
                await chat(content)  # one at a time: each speculates (a lone request)
            status = {}
            for _ in range(80):  # the scheduler adds its counters to Redis at its heartbeat
                status = get_json(f"{system.base_url}/status")["models"][MODEL]["speculative"]
                if status and status["requests"] == 2:
                    break
                await asyncio.sleep(0.25)
        assert status["method"] == "ngram" and status["num_speculative_tokens"] == 4
        assert status["requests"] == 2 and sum(bucket["requests"] for bucket in status["request_acceptance_buckets"]) == 2
        assert 0 < status["accepted_tokens"] <= status["proposed_tokens"]
        assert status["acceptance_rate"] == status["accepted_tokens"] / status["proposed_tokens"]
        assert status["mean_acceptance_length"] == 1 + status["accepted_tokens"] / status["verifications"]
        with urllib.request.urlopen(f"{system.base_url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert (metric(metrics, "vllm:spec_decode_num_drafts_total"),
                metric(metrics, "vllm:spec_decode_num_draft_tokens_total"),
                metric(metrics, "vllm:spec_decode_num_accepted_tokens_total"),
                metric(metrics, "iterserve:spec_decode_request_acceptance_rate_count")) == (
            status["verifications"], status["proposed_tokens"], status["accepted_tokens"], status["requests"])

        async with Browser() as browser:
            await browser.open(f"{system.base_url}/dashboard")
            line = f"#speculation .model[data-model=\"{MODEL}\"]"
            await browser.wait_for(f"document.querySelector('{line}')?.dataset.requests === '2'",
                                   what="the model's speculation line")
            shown = await browser.evaluate(f"JSON.stringify(Object.assign({{}}, document.querySelector('{line}').dataset))")
            assert json.loads(shown) == {"model": MODEL, "verifications": str(status["verifications"]),
                                         "proposed": str(status["proposed_tokens"]),
                                         "kept": str(status["accepted_tokens"]), "requests": "2"}
            summary = await browser.evaluate(f"document.querySelector('{line} .summary').textContent")
            assert summary.startswith("ngram, up to 4 proposed a step")
            assert f"{status['accepted_tokens']} of {status['proposed_tokens']} proposed tokens kept " \
                   f"({100 * status['acceptance_rate']:.1f}%)" in summary
            assert f"mean acceptance length {status['mean_acceptance_length']:.2f} tokens" in summary
            bars = json.loads(await browser.evaluate(
                f"JSON.stringify([...document.querySelectorAll('{line} .bucket')].map(b => ({{le: Number(b.dataset.bound), "
                f"requests: Number(b.dataset.count)}})))"))
            assert bars == status["request_acceptance_buckets"]
            assert await browser.evaluate("getComputedStyle(document.getElementById('speculation-card')).display") \
                == "block"
            verified = await browser.wait_for("document.querySelectorAll('.iteration.verified').length",
                                              what="the steps that verified proposals, marked")
            assert 0 < verified <= status["verifications"]
            await browser.screenshot(tmp_path / "speculation.png")
