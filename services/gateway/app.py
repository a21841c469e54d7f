"""The gateway's aiohttp app: routes, the error middleware, and the server's lifetime.

    client --HTTP--> gateway --MULTI: record, active set, new stream--> Redis --> scheduler
    client <--JSON/SSE-- gateway <--XREAD token_stream(id)-- Redis <-- scheduler
"""

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.gateway.admission import Admission, load_api_keys
from services.gateway.api_models import MAX_N
from services.gateway.dashboard import dashboard_events, dashboard_page
from services.gateway.errors import ApiError, ServiceUnavailable, error_body, internal_error, unknown_request
from services.gateway.generation import create_chat_completion, create_completion, reattach_stream, visible_to
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import openapi_document
from services.gateway.state import ANSWER, CLIENT_KEY, ENDPOINT, STATE, GatewayModel, GatewayState
from services.gateway.store import REDIS_TIMEOUT_SECONDS, ClusterView, RequestState, Store
from services.gateway.tokenize import detokenize, tokenize
from shared.config import Settings, executor_label
from shared.messages import SchedulerInfo, WorkerInfo
from shared.model_file import load_metadata, serving_config
from shared.redis_connection import connect
from shared.served_models import served_models
from shared.speculative import speculation_status
from shared.startup_heap import freeze_startup_heap

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

log = logging.getLogger("iterserve.gateway")

HEALTH_TIMEOUT_SECONDS = 2.0  # /health answers 503 rather than wait longer on Redis
METRICS_TIMEOUT_SECONDS = 1.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0  # open streams get this long before their handlers are cancelled
# DELETE /v1/requests/{id} answers once the request has ended (the scheduler takes a cancel at its
# next turn, milliseconds), or after this long with the cancel recorded but the request not ended.
CANCEL_OUTCOME_WAIT_SECONDS, CANCEL_POLL_SECONDS = 5.0, 0.01


def create_app(settings: Settings, tokenizer: "Tokenizer | None" = None) -> web.Application:
    """The gateway app; the Redis client opens on startup and closes on cleanup."""
    from shared.tokenizer import Tokenizer  # noqa: F811 (the runtime import of the hint above)

    models = {}
    for served in served_models(settings):  # tokenizer: the first model's, already loaded (tests)
        model_tokenizer = tokenizer if tokenizer is not None and not models else Tokenizer.for_serving(
            served.path, settings.tokenizer, settings.chat_template)
        context_length = serving_config(load_metadata(served.path).config, settings.max_model_len).context_length
        models[served.name] = GatewayModel(served.name, model_tokenizer, context_length, served.keys)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[error_middleware, access_middleware])
    app[STATE] = GatewayState(
        settings=settings,
        models=models,
        metrics=GatewayMetrics(),
        started_at=int(time.time()),
        admission=Admission(settings, load_api_keys(settings)),
    )
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_name:.+}", get_model)
    app.router.add_get("/v1/requests/{request_id}", get_request)
    app.router.add_delete("/v1/requests/{request_id}", cancel_request)
    app.router.add_get("/v1/requests/{request_id}/stream", reattach_stream)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/livez", livez)
    app.router.add_get("/version", version)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/dashboard/events", dashboard_events)
    app.on_startup.append(_open_redis)
    app.on_startup.append(_follow_executors)
    app.on_cleanup.append(_close_redis)
    app.on_response_prepare.append(_name_the_executor)
    return app


EXECUTORS_EVERY_SECONDS = 2.0


async def _follow_executors(app: web.Application) -> None:
    """Reads each model's executors from its scheduler's heartbeat every EXECUTORS_EVERY_SECONDS, so
    that the first answers after a start name them too (not only those after a /health or /status
    read); cancelled at shutdown."""
    state = app[STATE]

    async def follow() -> None:
        while True:
            for model in list(state.models.values()):
                try:
                    state.note_executors(model.name, await state.store.scheduler_info(model.keys))
                except ServiceUnavailable:
                    pass  # Redis is away: the last ones stand; /health says why
                except Exception:  # (a bug must not stop the labels for good: said, and tried again)
                    log.exception("event=executors_refresh_failed model=%s", model.name)
            await asyncio.sleep(EXECUTORS_EVERY_SECONDS)

    state.executors_task = asyncio.get_running_loop().create_task(follow())


async def _name_the_executor(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer says what made it: "engine" (the model), or "emulated" (no model: a hardware
    profile's step times; tokens a hash of the context), as the workers' heartbeats last said."""
    response.headers["x-iterserve-executor"] = request.app[STATE].executor_header


async def _open_redis(app: web.Application) -> None:
    state = app[STATE]
    settings = state.settings
    state.store = Store(connect(settings.redis_url), settings.redis_wait_replicas, settings.redis_wait_ms,
                        state.metrics.unreplicated_acceptances.inc, sharded=settings.schedulers > 1)


async def _close_redis(app: web.Application) -> None:
    state = app[STATE]
    if state.executors_task is not None:
        state.executors_task.cancel()
    await state.drain_background()  # cancellations sent by handlers cut off at shutdown
    if state.store is not None:
        await state.store.aclose()


@web.middleware
async def access_middleware(request: web.Request, handler) -> web.StreamResponse:
    """API keys: a protected path needs a valid `Authorization: Bearer` key (401 otherwise)."""
    admission = request.app[STATE].admission
    if admission.protects(request.path):
        request[CLIENT_KEY] = admission.client_key(request)
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-style JSON error. An unexpected exception is a bug in the
    gateway: a 500 with an error body (not a 503, which invites the client to retry into the same
    bug), logged with the request's id."""
    code = None
    try:
        return await handler(request)
    except ApiError as error:
        response, code = error.response(), error.code
    except web.HTTPException as error:
        if error.status < 400:
            raise
        response = _http_error(request, error)
    except asyncio.CancelledError:
        raise
    except Exception:
        answer = request.get(ANSWER)
        log.exception("unexpected error method=%s path=%s id=%s", request.method, request.path,
                      answer.request_id if answer is not None else "-")
        internal = internal_error()
        response, code = internal.response(), internal.code
    _count_refusal(request, response.status)
    request.app[STATE].metrics.refusals.labels(str(response.status), code or "none").inc()
    log.info("refused status=%d %s %s error=%s", response.status, request.method, request.path, response.text)
    return response


def _http_error(request: web.Request, error: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (no route, wrong method, body too large) in the OpenAI shape."""
    headers = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        limit = request.app[STATE].settings.max_body_bytes
        message = f"request body too large: the limit is {limit} bytes"
        body = error_body(message, "invalid_request_error", None, "request_too_large")
    elif isinstance(error, web.HTTPNotFound):
        body = error_body(f"Invalid URL ({request.method} {request.path})", "invalid_request_error")
    elif isinstance(error, web.HTTPMethodNotAllowed):
        body = error_body(f"Method {request.method} not allowed for {request.path}", "invalid_request_error")
    else:
        body = error_body(error.reason, "invalid_request_error")
    return web.json_response(body, status=error.status, headers=headers)


def _count_refusal(request: web.Request, status: int) -> None:
    endpoint = request.get(ENDPOINT)
    answer = request.get(ANSWER)
    if endpoint is None:
        return
    if answer is not None:
        answer.count_outcome(str(status))
    else:
        request.app[STATE].metrics.requests.labels(endpoint, str(status)).inc()


def _model_card(state: GatewayState, model: GatewayModel) -> dict:
    return {
        "id": model.name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "iterserve",
        "max_model_len": model.context_length,
    }


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [_model_card(state, model) for model in state.models.values()]
    return web.json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model_name"]
    if name not in state.models:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return web.json_response(_model_card(state, state.models[name]))


async def get_request(request: web.Request) -> web.Response:
    state = request.app[STATE]
    request_id = request.match_info["request_id"]
    request_state = await state.store.request_state(request_id)
    if request_state is None or not visible_to(request, request_state):
        raise unknown_request(request_id)
    record = request_state.record
    return web.json_response(
        {
            "id": request_id,
            "object": "request",
            "status": request_state.status,
            "finish_reason": request_state.finish_reason,
            "created": int(record.arrival_time) if record else None,
            "model": state.model_of(request_state).name,
            "prompt_tokens": len(record.prompt_token_ids) if record else None,
            "max_tokens": record.sampling.max_tokens if record else None,
            "token_events": await state.store.token_event_count(request_id),  # output entries so far
        }
    )


async def cancel_request(request: web.Request) -> web.Response:
    """DELETE /v1/requests/{id}: harmless on a request that already ended (cancelled: false)."""
    state = request.app[STATE]
    request_id = request.match_info["request_id"]
    request_state = await state.store.request_state(request_id)
    if request_state is None or not visible_to(request, request_state):
        raise unknown_request(request_id)
    cancelled = not request_state.terminal
    await _cancel_other_choices(state, request_id, state.model_of(request_state).keys)
    if cancelled:
        await state.store.cancel(request_id, state.model_of(request_state).keys)
        # Answer with how the request ended, not with what was asked: a cancel that reaches the
        # scheduler after it applied the request's last token changes nothing (it finished).
        ended = await _ended(state, request_id, CANCEL_OUTCOME_WAIT_SECONDS)
        if ended is not None:
            request_state, cancelled = ended, ended.status == "cancelled"
    log.info("cancel requested id=%s status=%s cancelled=%s", request_id, request_state.status, cancelled)
    return web.json_response(
        {"id": request_id, "object": "request.cancel", "status": request_state.status, "cancelled": cancelled}
    )


async def _cancel_other_choices(state: GatewayState, request_id: str, keys) -> None:
    """An answer of n choices: its id names choice 0, and cancelling it cancels the others
    (`<id>.1`, `<id>.2`, ...: services/gateway/choices.py)."""
    if "." in request_id:
        return
    for index in range(1, MAX_N):
        other = await state.store.request_state(f"{request_id}.{index}")
        if other is None:
            return
        if not other.terminal:
            await state.store.cancel(f"{request_id}.{index}", keys)


async def _ended(state: GatewayState, request_id: str, timeout: float) -> RequestState | None:
    """The request's state once it has ended (None if it has not within timeout: no scheduler)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(CANCEL_POLL_SECONDS)
        found = await state.store.request_state(request_id)
        if found is None or found.terminal:
            return found
    return None


def stall_reason(scheduler: SchedulerInfo | None, stall_seconds: float, now: float) -> str | None:
    """Why the scheduler looks stuck (requests wait, no iteration for stall_seconds), or None."""
    if scheduler is None or scheduler.waiting <= 0:
        return None
    if scheduler.last_iteration_at > 0:
        idle = now - scheduler.last_iteration_at
        if idle > stall_seconds:
            return f"{scheduler.waiting} requests waiting and no iteration for {idle:.1f} s"
    elif now - scheduler.started_at > stall_seconds:
        return f"{scheduler.waiting} requests waiting and no iteration since the scheduler started"
    return None


async def _views(state: GatewayState, timeout: float) -> list[tuple[GatewayModel, ClusterView]]:
    """Every served model's pool, read concurrently."""
    models = list(state.models.values())
    views = await asyncio.gather(*(state.store.cluster_view(model.keys, timeout) for model in models))
    for model, view in zip(models, views):
        state.note_executors(model.name, view.scheduler)
    return list(zip(models, views, strict=True))


async def livez(request: web.Request) -> web.Response:
    """200 whenever this gateway serves HTTP, whatever Redis, the scheduler or the workers do: an
    orchestrator's restart probe (restarting a gateway cannot bring a worker back; /health is the
    readiness probe)."""
    return web.json_response({"status": "alive"})


async def version(request: web.Request) -> web.Response:
    """This server's version (vLLM's /version)."""
    from importlib.metadata import PackageNotFoundError, version as installed_version

    try:
        number = installed_version("iterserve")
    except PackageNotFoundError:  # (run from a checkout that was not installed)
        number = "unknown"
    return web.json_response({"version": number})


async def health(request: web.Request) -> web.Response:
    """200 only when Redis, and for every served model its scheduler and at least one worker, are
    alive and requests move."""
    state = request.app[STATE]
    unavailable = {"status": "unavailable"}
    if not await state.store.ping(HEALTH_TIMEOUT_SECONDS):
        return web.json_response({**unavailable, "missing": ["redis"]}, status=503)
    try:
        views = await _views(state, HEALTH_TIMEOUT_SECONDS)
    except ServiceUnavailable:
        return web.json_response({**unavailable, "missing": ["redis"]}, status=503)
    missing, reasons = [], []
    for model, view in views:
        suffix = f":{model.name}" if len(views) > 1 else ""  # which model lacks it, when there are several
        if not view.scheduler_key_exists:
            missing.append("scheduler" + suffix)
        # A worker counts once its scheduler has seen it too (its heartbeat names the worker's
        # executor): until then no request can be placed, and no answer could say what made it.
        scheduler_sees_none = view.scheduler is not None and not view.scheduler.executors
        if not view.live_worker_ids or scheduler_sees_none:
            missing.append("workers" + suffix)
        stalled = stall_reason(view.scheduler, state.settings.stall_seconds, time.time())
        if stalled:
            missing.append("progress" + suffix)
            reasons.append(stalled + suffix.replace(":", " for model ", 1))
    if missing:
        body = {**unavailable, "missing": missing}
        if reasons:
            body["reason"] = "; ".join(reasons)
        return web.json_response(body, status=503)
    executors = state.executor_header
    return web.json_response(
        {
            "status": "ok",
            "model": state.model_name,
            "executor": executors,
            **({"note": "EMULATED workers: no model runs; step times come from a hardware profile"}
               if "emulated" in executors else {}),
            "workers": sum(len(view.live_worker_ids) for _, view in views),
            "waiting": sum(view.scheduler.waiting for _, view in views if view.scheduler),
            "running": sum(view.scheduler.running for _, view in views if view.scheduler),
            "models": {model.name: {"workers": len(view.live_worker_ids),
                                    "executors": list(view.scheduler.executors) if view.scheduler else []}
                       for model, view in views},
        }
    )


def _worker_status(model: GatewayModel, worker: WorkerInfo) -> dict:
    return {
        "id": worker.worker_id,
        "model": model.name,
        "weights_sha256": worker.weights_sha256,
        "kv_bytes_per_token": worker.kv_bytes_per_token,
        "pid": worker.pid,
        "host": worker.host,
        "device": worker.device,
        "executor": worker.executor,
        **({"hardware": worker.hardware} if worker.executor == "emulated" else {}),
        "busy_seconds": round(worker.busy_seconds, 6),
        "kv_blocks_total": worker.kv_blocks_total,
        "kv_blocks_free": worker.kv_blocks_free,
        "kv_blocks_cached": worker.kv_blocks_cached,
        "kv_blocks_in_use": worker.kv_blocks_total - worker.kv_blocks_free - worker.kv_blocks_cached,
        "running": worker.running,
        "draining": worker.draining,
        "heartbeat_at": worker.heartbeat_at,
    }


def _speculative(view: ClusterView) -> dict | None:
    """A model's speculative decoding: its method, proposals kept, per-request acceptance (None: none)."""
    scheduler = view.scheduler
    return speculation_status(view.counters, scheduler.speculative_method if scheduler else "",
                              scheduler.num_speculative_tokens if scheduler else 0)


async def status(request: web.Request) -> web.Response:
    """Every worker of every model, the queue totals, and each model's own: its scheduler, queue
    and workers (`scheduler` at the top is the first model's, as before there were several)."""
    views = await _views(request.app[STATE], REDIS_TIMEOUT_SECONDS)
    per_model = {
        model.name: {
            "waiting": view.scheduler.waiting if view.scheduler else 0,
            "running": view.scheduler.running if view.scheduler else 0,
            "active_requests": view.active_requests,
            "workers": [worker.worker_id for worker in view.workers],
            "scheduler": view.scheduler.model_dump(mode="json") if view.scheduler else None,
            # Several schedulers (--schedulers N): each one, its workers and their fencing tokens.
            "schedulers": [{"scheduler_id": info.scheduler_id, "pid": info.pid, "waiting": info.waiting,
                            "running": info.running, "iterations": info.iterations, "leases": info.leases}
                           for info in view.schedulers if info.scheduler_id],
            "speculative": _speculative(view),
        }
        for model, view in views
    }
    first = per_model[views[0][0].name]
    return web.json_response(
        {
            "workers": [_worker_status(model, worker) for model, view in views for worker in view.workers],
            "waiting": sum(block["waiting"] for block in per_model.values()),
            "running": sum(block["running"] for block in per_model.values()),
            "active_requests": sum(block["active_requests"] for block in per_model.values()),
            "scheduler": first["scheduler"],
            "models": per_model,
        }
    )


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        views = await _views(state, METRICS_TIMEOUT_SECONDS)
    except ServiceUnavailable:
        views = None
    state.metrics.observe_cluster(None if views is None else [(model.name, view) for model, view in views])
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    document = openapi_document(state.settings, state.model_name, state.admission.keys_required,
                                state.context_length, state.tokenizer.vocab_size)
    return web.json_response(document)


def warn_if_open(state: GatewayState) -> None:
    """Say at start-up who can use the server."""
    settings = state.settings
    if state.admission.keys_required:
        log.info("API keys required on /v1/*%s", " and /metrics, /status" if settings.protect_observability else "")
    elif settings.host in ("127.0.0.1", "localhost", "::1"):
        log.warning("no API keys configured: the API is open to every process on this machine (bound to %s); "
                    "set ITERSERVE_API_KEYS or ITERSERVE_API_KEYS_FILE to require keys", settings.host)
    else:
        log.warning("no API keys configured and bound to %s: the API is OPEN to anyone who can reach this "
                    "address; set ITERSERVE_API_KEYS or ITERSERVE_API_KEYS_FILE", settings.host)


async def run_gateway(settings: Settings, stop_event: asyncio.Event | None = None) -> None:
    """Serve on settings.host:settings.port until stop_event is set (forever without one)."""
    app = create_app(settings)
    warn_if_open(app[STATE])
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_SECONDS
    )
    await runner.setup()
    freeze_startup_heap("gateway")
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        log.info("gateway listening on %s model=%s executor=%s", runner.addresses, app[STATE].model_name,
                 executor_label(settings))
        await (stop_event or asyncio.Event()).wait()
        log.info("gateway stopping")
        app[STATE].stopping = True
    finally:
        await runner.cleanup()
