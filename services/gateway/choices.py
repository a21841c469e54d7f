"""n > 1: several choices of one prompt. Each choice is a request of its own to the scheduler, so
batching, moves, preemption and restarts treat it as any request and its tokens stay exact: choice i
draws from the seed (seed + i) mod 2**63, its tokens those of the same request with n = 1 and that
seed. Its id is the answer's for choice 0 and `<id>.<i>` for the others (DELETE of the answer's id
cancels every choice; a choice can be re-attached to by its own id).

The prompt is prefilled once: choice 0 goes first, and the others are submitted when its first token
arrives, by which time its prompt's full KV blocks are in the prefix cache of the worker that holds
them, where the others are placed and adopt them (only the last, partial block is computed again
per choice). Without prefix caching all choices go at once. A client that leaves cancels them all.
"""

import asyncio
import logging
import time
from contextlib import aclosing

from aiohttp import web

from services.gateway.api_models import SEED_RANGE, GenerationParams
from services.gateway.errors import ApiError
from services.gateway.generation import (
    KEEPALIVE_SECONDS,
    ClientGone,
    admit,
    answer_parts,
    new_answer,
    request_failed,
    stored_tool_format,
    transport_closed,
    with_prompt_logprobs,
)
from services.gateway.responses import (
    DONE_EVENT,
    KEEPALIVE_EVENT,
    ChunkWriter,
    Endpoint,
    final_choice,
    sse,
    usage,
    whole_body,
)
from services.gateway.state import ANSWER, CLIENT_KEY, GatewayModel, GatewayState
from services.gateway.tools import ToolPlan
from shared.messages import RequestRecord

log = logging.getLogger("iterserve.gateway")


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}.{index}"


async def generate_choices(request: web.Request, state: GatewayState, model: GatewayModel, endpoint: Endpoint,
                           params: GenerationParams, record: RequestRecord, tools: ToolPlan | None, started: float,
                           count: int) -> web.StreamResponse:
    # (the prompt's log-probabilities are choice 0's to compute: the others' prompt is the same)
    records = [record.model_copy(update={
        "request_id": choice_id(record.request_id, index),
        "sampling": record.sampling.model_copy(update={"seed": (record.sampling.seed + index) % SEED_RANGE,
                                                       **({"prompt_logprobs": -1} if index else {})})})
        for index in range(count)]
    client_key = request.get(CLIENT_KEY, record.client_key)
    tickets = []
    try:
        for _ in records:
            tickets.append(await admit(state, model, client_key, len(record.prompt_token_ids)))
        await state.store.submit(records[0], model.name, model.keys, stored_tool_format(tools))
    except BaseException:
        for ticket in tickets:
            ticket.close()
        raise
    log.info("accepted id=%s endpoint=%s choices=%d prompt_tokens=%d max_tokens=%d stream=%s seed=%d",
             record.request_id, endpoint.name, count, len(record.prompt_token_ids), record.sampling.max_tokens,
             bool(params.stream), record.sampling.seed)
    state.metrics.prompt_tokens.inc(len(record.prompt_token_ids))
    state.metrics.vllm.of(model.name).prompt_tokens.inc(len(record.prompt_token_ids))
    answers = [new_answer(state, model, endpoint, params, choice, tools, started) for choice in records]
    for index, (answer, ticket) in enumerate(zip(answers, tickets)):
        answer.index, answer.ticket = index, ticket
    request[ANSWER] = answers[0]
    # (choice 0's prompt log-probabilities are written before its first token: the others' answers,
    # which show them too, come after it)
    together = not state.settings.prefix_caching and record.sampling.prompt_logprobs < 0

    async def read_prompt_logprobs() -> None:
        await answers[0].read_prompt_logprobs()
        for answer in answers[1:]:
            answer.prompt = answers[0].prompt

    async def submitted(index: int) -> None:
        """Choice index is in the pool: after choice 0's first token (its prompt cached by then)."""
        if index == 0:
            return
        if not together:
            await answers[0].first_token.wait()
        await state.store.submit(records[index], model.name, model.keys, stored_tool_format(tools))

    async def follow(index: int, sink: asyncio.Queue) -> None:
        """Choice index's events into the sink (an exception too, raised where the sink is read)."""
        try:
            await submitted(index)
            answer = answers[index]
            async with aclosing(state.store.follow_tokens(answer.request_id, 0, answer.resubmit)) as events:
                async for event in events:
                    await sink.put((index, event))
                    if event is not None and event.finish_reason is not None:
                        return
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 (handed to the reader, which raises it)
            await sink.put((index, error))

    sink: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(follow(index, sink)) for index in range(count)]
    chunks = ChunkWriter(endpoint, record.request_id, int(record.arrival_time), model.name, params.include_usage)
    response: web.StreamResponse | None = None
    ends: dict[int, object] = {}
    try:
        with state.metrics.in_flight.track_inprogress():
            if params.stream:
                response = web.StreamResponse(headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                    "X-Request-Id": record.request_id})
                await response.prepare(request)
                for answer in answers:
                    if endpoint.is_chat:
                        await response.write(chunks.role(answer.index))
                    if answer.echo and answer.echo_top < 0:
                        await response.write(chunks.text(answer.echo, index=answer.index))
            echoes_due = response is not None and answers[0].echo_top >= 0  # with their logprobs, read at a first token
            last_write = time.monotonic()
            while len(ends) < count:
                index, event = await sink.get()
                if isinstance(event, BaseException):
                    raise event
                answer = answers[index]
                if event is None:
                    if transport_closed(request):
                        raise ClientGone
                    if response is not None and time.monotonic() - last_write > KEEPALIVE_SECONDS:
                        await response.write(KEEPALIVE_EVENT)
                        last_write = time.monotonic()
                    continue
                if echoes_due:
                    await read_prompt_logprobs()
                    for each in answers:
                        await response.write(chunks.text(each.echo, logprobs=each.echo_logprobs(), index=each.index))
                    echoes_due = False
                answer.add(event)
                if event.finish_reason is None:
                    if response is not None and event.text and not answer.tool_format:
                        await response.write(chunks.text(event.text, index=index, logprobs=answer.unsent_logprobs()))
                        last_write = time.monotonic()
                    continue
                ends[index] = (event, answer.finish(event))
                if event.finish_reason == "error":
                    raise request_failed(answer.request_id)
                if response is not None:
                    await response.write(_last_chunk(chunks, answer, event))
            prompt_usage = ends[0][1]
            total = usage(prompt_usage["prompt_tokens"], sum(used["completion_tokens"] for _, used in ends.values()),
                          prompt_usage["prompt_tokens_details"]["cached_tokens"])
            if response is not None:
                if params.include_usage:
                    await response.write(chunks.usage(total))
                await response.write(DONE_EVENT)
                await response.write_eof()
                return response
            await read_prompt_logprobs()
            body = whole_body(endpoint, record.request_id, int(record.arrival_time), model.name,
                              [_whole_choice(answers[index], ends[index][0]) for index in range(count)], total)
            with_prompt_logprobs(body, answers)
            return web.json_response(body)
    except (ClientGone, ConnectionError):
        for answer in answers:
            answer.client_gone(cancel=True)
        return response if response is not None else web.Response(status=499)
    except asyncio.CancelledError:
        for answer in answers:
            answer.client_gone(cancel=True)
        raise
    except ApiError as error:
        for answer in answers:
            answer.abandon(error.message)
        if response is None or not response.prepared:
            raise
        await response.write(sse(error.body()) + DONE_EVENT)
        return response
    finally:
        for task in tasks:
            task.cancel()
        for ticket in tickets:
            ticket.close()


def _whole_choice(answer, event) -> dict:
    content, calls, finish = answer_parts(answer, event)
    return final_choice(answer.endpoint, answer.index, content, finish, answer.logprobs_body(), calls)


def _last_chunk(chunks: ChunkWriter, answer, event) -> bytes:
    if answer.tool_format:
        content, calls, finish = answer_parts(answer, event)
        return chunks.answer(content, calls, finish, None, answer.unsent_logprobs(), index=answer.index)
    return chunks.text(event.text, event.finish_reason, logprobs=answer.unsent_logprobs(), index=answer.index)
