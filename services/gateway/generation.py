"""The generation endpoints: validate, tokenize, accept into Redis, then answer whole or as SSE.

A client that goes away before its request's final token cancels the request (XADD
CANCEL_STREAM). aiohttp cancels the handler when the connection drops (handler_cancellation),
and independently every idle wait checks the transport and every stream write can fail.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing

from aiohttp import web
from jinja2 import TemplateError

from services.gateway.admission import OPEN_KEY_ID, Ticket
from services.gateway.api_models import GenerationParams, parse_body
from services.gateway.errors import ApiError, bad_request, internal_error, unknown_request
from services.gateway.prompt_logprobs import PromptLogprobs, assemble, echo_logprobs_body, joined, vllm_body
from services.gateway.responses import (
    CHAT,
    COMPLETIONS,
    DONE_EVENT,
    KEEPALIVE_EVENT,
    ChunkWriter,
    Endpoint,
    TokenLogprob,
    endpoint_of,
    final_body,
    logprobs_body,
    sse,
    usage,
)
from services.gateway.state import ANSWER, CLIENT_KEY, ENDPOINT, STATE, GatewayModel, GatewayState
from services.gateway.store import RequestState
from services.gateway.tools import ToolPlan, parse_answer, plan_tools
from shared.grammar import InvalidConstraint
from shared.messages import RequestRecord, StructuredOutput, TokenEvent

log = logging.getLogger("iterserve.gateway")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INLINE_TOKENIZE_CHARS = 4096  # longer texts are tokenized off the event loop
KEEPALIVE_SECONDS = 10.0  # an idle stream sends an SSE comment this often (finds gone clients)


class ClientGone(Exception):
    """The client's connection closed before its request finished."""


async def create_completion(request: web.Request) -> web.StreamResponse:
    return await generate(request, COMPLETIONS)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT)


async def generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    request[ENDPOINT] = endpoint.name
    arrival_time, started = time.time(), time.monotonic()
    settings = state.settings
    limits = {"max_stop_strings": settings.max_stop_strings, "max_stop_length": settings.max_stop_length}
    params = parse_body(endpoint.request_type, await request.read(), limits)
    model = state.model(params.model)
    await check_output_controls(model, params)
    tools = None
    if endpoint.is_chat:  # the tools offered and the calls made so far (services/gateway/tools.py)
        tools = plan_tools(params, model.tokenizer.chat_template_source)
        if tools.constraint is not None:
            await _check_constraint(model, tools.constraint, "tools")
    prompt_token_ids = await tokenize_prompt(model, endpoint, params, tools)
    max_tokens = resolve_max_tokens(state, model, endpoint, params, len(prompt_token_ids))
    request_id = endpoint.new_request_id()
    sampling = params.sampling_params(max_tokens, tools.constraint if tools else None)
    client_key = request.get(CLIENT_KEY, OPEN_KEY_ID)
    record = RequestRecord(
        request_id=request_id, prompt_token_ids=tuple(prompt_token_ids), sampling=sampling, arrival_time=arrival_time,
        client_key=client_key,
    )
    choices = params.n or 1
    if choices > 1:  # n > 1: each choice a request of its own (services/gateway/choices.py)
        from services.gateway.choices import generate_choices

        return await generate_choices(request, state, model, endpoint, params, record, tools, started, choices)
    ticket = await admit(state, model, client_key, len(prompt_token_ids))
    try:
        await state.store.submit(record, model.name, model.keys, stored_tool_format(tools))
    except BaseException:
        ticket.close()
        raise
    log.info(
        "accepted id=%s endpoint=%s prompt_tokens=%d max_tokens=%d stream=%s temperature=%s seed=%d",
        request_id, endpoint.name, len(prompt_token_ids), max_tokens, bool(params.stream),
        sampling.temperature, sampling.seed,
    )  # fmt: skip
    state.metrics.prompt_tokens.inc(len(prompt_token_ids))
    state.metrics.vllm.of(model.name).prompt_tokens.inc(len(prompt_token_ids))
    answer = new_answer(state, model, endpoint, params, record, tools, started)
    answer.ticket = ticket
    request[ANSWER] = answer
    try:
        with state.metrics.in_flight.track_inprogress():
            if params.stream:
                return await stream_answer(request, answer, params.include_usage, cancel_on_disconnect=True)
            return await whole_answer(request, answer)
    finally:
        ticket.close()


def new_answer(state: GatewayState, model: GatewayModel, endpoint: Endpoint, params: GenerationParams,
               record: RequestRecord, tools: ToolPlan | None, started: float) -> "Answer":
    """The answer that follows one accepted request (submitted again from it if Redis lost it)."""
    answer = Answer(state, model, endpoint, record.request_id, int(record.arrival_time), len(record.prompt_token_ids),
                    started=started, logprobs=record.sampling.logprobs >= 0)
    answer.tool_format = stored_tool_format(tools) or None
    if getattr(params, "echo", None) is True:  # completions: the text starts with the prompt's
        prompt = params.prompt
        answer.echoing(prompt if isinstance(prompt, str) else model.tokenizer.decode(record.prompt_token_ids),
                       params.echo_logprobs())
    answer.prompt_top = params.prompt_logprobs
    answer.prompt_token_ids = record.prompt_token_ids
    answer.resubmit = lambda: state.store.submit(record, model.name, model.keys, stored_tool_format(tools))
    return answer


def stored_tool_format(tools: ToolPlan | None) -> str:
    """The format of the tool calls an answer may hold ("": none), kept in the request's hash."""
    return tools.format if tools and tools.format != "none" else ""


async def admit(state: GatewayState, model: GatewayModel, client_key: str, prompt_tokens: int) -> Ticket:
    """A place among the waiting requests, or a 429 (services/gateway/admission.py)."""
    admission = state.admission
    # (Redis down: 503, as submit would.) The heartbeat read also names the model's executors, read
    # now when they are not known yet, so that this very answer says what made it.
    if admission.needs_scheduler_view() or model.name not in state.executors:
        scheduler = await state.store.scheduler_info(model.keys)
        admission.note_scheduler(scheduler)
        state.note_executors(model.name, scheduler)
    return admission.admit(client_key, prompt_tokens)


def visible_to(request: web.Request, request_state: RequestState) -> bool:
    """Only the key that sent a request may look it up, cancel it or re-attach to it."""
    client_key = request.get(CLIENT_KEY, OPEN_KEY_ID)
    if client_key == OPEN_KEY_ID:
        return not request.app[STATE].admission.keys_required
    return request_state.record is not None and request_state.record.client_key == client_key


async def check_output_controls(model: GatewayModel, params: GenerationParams) -> None:
    """A 400 naming the parameter for a constraint the workers could not compile, or a logit_bias
    key that is not a token of the model."""
    vocab_size = model.tokenizer.vocab_size
    bad = next((token_id for token_id in params.logit_bias_ids() if token_id >= vocab_size), None)
    if bad is not None:
        raise bad_request(f"`logit_bias` names token {bad}, out of the vocabulary (0..{vocab_size - 1})",
                          param="logit_bias")
    structured = params.structured_output()
    if structured is None:
        return
    await _check_constraint(model, *structured)


async def _check_constraint(model: GatewayModel, constraint: StructuredOutput, param: str) -> None:
    try:
        await asyncio.to_thread(model.check_constraint, constraint)
    except InvalidConstraint as error:
        raise bad_request(f"`{param}` cannot be used as a constraint: {error}", param=param) from None


async def tokenize_prompt(model: GatewayModel, endpoint: Endpoint, params: GenerationParams,
                          tools: ToolPlan | None = None) -> list[int]:
    tokenizer = model.tokenizer
    if endpoint.is_chat:
        messages = tools.messages if tools else [message.as_template_message() for message in params.messages]
        template_tools = tools.template_tools if tools else None
        size = sum(len(message["content"] or "") for message in messages)

        def work() -> list[int]:
            return tokenizer.encode_chat(messages, tools=template_tools)
    elif isinstance(params.prompt, str):
        size = len(params.prompt)

        def work() -> list[int]:
            return tokenizer.encode_prompt(params.prompt)
    else:
        token_ids = list(params.prompt)
        bad = next((token_id for token_id in token_ids if not 0 <= token_id < tokenizer.vocab_size), None)
        if bad is not None:
            message = f"token id {bad} is out of the vocabulary (0..{tokenizer.vocab_size - 1})"
            raise bad_request(message, param="prompt")
        work = None
    try:
        if work is not None:
            token_ids = await asyncio.to_thread(work) if size > INLINE_TOKENIZE_CHARS else work()
    except (TemplateError, TypeError) as error:  # the template refuses a conversation (e.g. roles out of order)
        raise bad_request(f"the chat template refused these messages: {error}", param="messages") from None
    if not token_ids:
        raise bad_request("the prompt is empty", param=endpoint.prompt_param)
    return token_ids


def resolve_max_tokens(state: GatewayState, model: GatewayModel, endpoint: Endpoint, params: GenerationParams,
                       prompt_tokens: int) -> int:
    """The output budget; a request that cannot fit the context or the server's limits is refused, never clipped."""
    context = model.context_length
    prompt_limit, output_limit = state.settings.max_prompt_tokens, state.settings.max_tokens_limit
    if prompt_limit and prompt_tokens > prompt_limit:
        raise bad_request(
            f"prompt too long: {prompt_tokens} tokens, and this server takes at most {prompt_limit}",
            param=endpoint.prompt_param,
            code="prompt_too_long",
        )
    requested = params.requested_max_tokens()
    if output_limit and requested is not None and requested > output_limit:
        param = "max_completion_tokens" if params.max_completion_tokens else "max_tokens"
        raise bad_request(
            f"`{param}` is {requested}, and this server generates at most {output_limit} tokens per request",
            param=param,
            code="max_tokens_exceeded",
        )
    if prompt_tokens >= context:
        raise bad_request(
            f"prompt too long: {prompt_tokens} tokens, and this model's context length is {context} tokens",
            param=endpoint.prompt_param,
            code="context_length_exceeded",
        )
    remaining = context - prompt_tokens
    if requested is None:
        default = remaining if endpoint.is_chat else min(DEFAULT_COMPLETION_MAX_TOKENS, remaining)
        return min(default, output_limit) if output_limit else default
    if requested > remaining:
        raise bad_request(
            f"this model's context length is {context} tokens, but the prompt has {prompt_tokens} tokens and "
            f"{requested} output tokens were requested ({prompt_tokens + requested} in all): "
            "shorten the prompt or lower max_tokens",
            param="max_completion_tokens" if params.max_completion_tokens else "max_tokens",
            code="context_length_exceeded",
        )
    return requested


class Answer:
    """One request's output as it arrives: its text, its token timings, its metrics and log lines."""

    def __init__(
        self,
        state: GatewayState,
        model: GatewayModel,
        endpoint: Endpoint,
        request_id: str,
        created: int,
        prompt_tokens: int,
        started: float | None = None,  # monotonic arrival; None for a re-attached stream (no metrics)
        start_index: int = 0,
        logprobs: bool = False,  # the request asked for logprobs
    ) -> None:
        self.state, self.model, self.endpoint, self.request_id = state, model, endpoint, request_id
        self.vllm = state.metrics.vllm.of(model.name)  # its model's vLLM-named series
        self.created, self.prompt_tokens = created, prompt_tokens
        self.started, self.start_index = started, start_index
        self.pieces: list[str] = []
        self.tokens_seen = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished = False
        self.outcome_counted = False
        self.ticket: Ticket | None = None  # its place among the waiting requests and the key's open ones
        # Submits it again if Redis lost it (Store.follow_tokens): set by the gateway that accepted it, holding it
        self.resubmit: Callable[[], Awaitable[None]] | None = None
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None  # every token's, in order
        self.echo = ""  # the prompt's text, answered before the output's (completions' echo)
        # The prompt's log-probabilities (services/gateway/prompt_logprobs.py), read after the first
        # token: asked for as vLLM's prompt_logprobs (with this many most likely tokens), or as the
        # echo's logprobs (this many; -1: not asked)
        self.prompt_top: int | None = None
        self.echo_top = -1
        self.prompt_token_ids: tuple[int, ...] = ()
        self.prompt: PromptLogprobs | None = None
        self.tool_format: str | None = None  # the answer may hold tool calls in this format: read at its end
        self.index = 0  # its choice (n > 1)
        self.first_token = asyncio.Event()  # set at its first token, or at its end
        self._logprobs_sent = 0  # how many of them a stream has sent
        self._characters = 0  # length of the text so far (the next token's text_offset)

    def count_outcome(self, outcome: str) -> None:
        if self.started is not None and not self.outcome_counted:
            self.outcome_counted = True
            self.state.metrics.requests.labels(self.endpoint.name, outcome).inc()

    def echoing(self, text: str, top: int) -> None:
        """Completions' echo: the answer's text starts with `text` (the prompt's), with the logprobs of
        its tokens and `top` most likely ones at each when top >= 0."""
        self.echo, self.echo_top = text, top
        self._characters = len(text)  # (text_offset counts from the start of the answer's text)

    def add(self, event: TokenEvent) -> None:
        if self.logprobs is not None and event.logprob is not None and event.token_id >= 0:
            self.logprobs.append(TokenLogprob(event.token_id, event.logprob, event.top_logprobs, self._characters))
        if event.text:
            self.pieces.append(event.text)
            self._characters += len(event.text)
        if event.token_id >= 0:
            now = time.monotonic()
            self.tokens_seen += 1
            if self.first_token_at is None:
                self.first_token_at = now
                self.first_token.set()
                if self.ticket is not None:
                    self.ticket.started()
                if self.started is not None:
                    self.state.metrics.time_to_first_token.observe(now - self.started)
                    self.vllm.time_to_first_token.observe(now - self.started)
                    self.state.metrics.recent.note("ttft", now - self.started)
            elif self.started is not None:
                self.vllm.inter_token_latency.observe(now - self.last_token_at)
            self.last_token_at = now

    def finish(self, event: TokenEvent) -> dict:
        """Record the final event; returns the usage block."""
        self.finished = True
        self.first_token.set()
        prompt_tokens = event.prompt_tokens or self.prompt_tokens
        completion_tokens = event.completion_tokens or (self.start_index + self.tokens_seen)
        if event.token_id < 0:
            # An end without a token (a cancel, an error) counts what the stream carried: a worker may
            # have written the entry of a token sampled in flight that the scheduler never applied.
            completion_tokens = max(completion_tokens, self.start_index + self.tokens_seen)
        if self.started is not None:
            self.count_outcome(event.finish_reason)
            metrics = self.state.metrics
            metrics.completion_tokens.inc(completion_tokens)
            metrics.e2e_latency.observe(time.monotonic() - self.started)
            self.vllm.generation_tokens.inc(completion_tokens)
            self.vllm.e2e_request_latency.observe(time.monotonic() - self.started)
            if self.tokens_seen > 1:
                decode_seconds = self.last_token_at - self.first_token_at
                metrics.time_per_output_token.observe(decode_seconds / (self.tokens_seen - 1))
                metrics.recent.note("tpot", decode_seconds / (self.tokens_seen - 1))
        log.info(
            "finished id=%s finish_reason=%s prompt_tokens=%d completion_tokens=%d seconds=%.3f",
            self.request_id, event.finish_reason, prompt_tokens, completion_tokens,
            time.monotonic() - self.started if self.started is not None else -1.0,
        )  # fmt: skip
        return usage(prompt_tokens, completion_tokens, event.cached_tokens)

    def client_gone(self, cancel: bool) -> None:
        """The client left before the final token: cancel the request unless it already finished."""
        if self.finished:
            return
        if self.state.stopping:  # the gateway closes the connection, not the client: keep the request
            log.info("gateway stopping, request goes on id=%s (re-attach: GET /v1/requests/%s/stream?from=N)",
                     self.request_id, self.request_id)
            return
        log.info("client disconnected id=%s cancel=%s", self.request_id, cancel)
        self.count_outcome("client_disconnected")
        if cancel:
            self.state.cancel_in_background(self.request_id, "client disconnected")

    def abandon(self, reason: str) -> None:
        """The gateway answers with an error before the final token: nobody will read the rest."""
        if not self.finished and self.started is not None:
            self.state.cancel_in_background(self.request_id, reason)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def logprobs_body(self) -> dict | None:
        body = logprobs_body(self.endpoint, self.logprobs, self.model.tokenizer)
        if self.echo_top >= 0 and self.prompt is not None:  # the echoed prompt's tokens come first
            return joined(self.echo_logprobs(), body)
        return body

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_top is not None or self.echo_top >= 0

    async def read_prompt_logprobs(self) -> None:
        """Read the prompt's log-probabilities (once its first token is out: the worker wrote them before)."""
        if self.wants_prompt_logprobs and self.prompt is None:
            chunks = await self.state.store.prompt_logprobs_chunks(self.request_id)
            self.prompt = assemble(self.request_id, self.prompt_token_ids, chunks)

    def echo_logprobs(self) -> dict | None:
        if self.prompt is None or self.echo_top < 0:
            return None
        return echo_logprobs_body(self.prompt, self.echo_top, self.model.tokenizer)

    def prompt_logprobs_body(self) -> list | None:
        """vLLM's prompt_logprobs (a completion choice's, or a chat answer's), when asked for."""
        if self.prompt is None or self.prompt_top is None:
            return None
        return vllm_body(self.prompt, self.prompt_top, self.model.tokenizer)

    def unsent_logprobs(self) -> dict | None:
        """The logprobs of the tokens not yet streamed (a token without text waits for the next chunk)."""
        if self.logprobs is None:
            return None
        unsent = self.logprobs[self._logprobs_sent :]
        self._logprobs_sent = len(self.logprobs)
        return logprobs_body(self.endpoint, unsent, self.model.tokenizer)


def transport_closed(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def whole_answer(request: web.Request, answer: Answer) -> web.StreamResponse:
    try:
        event = await _final_event(request, answer)
    except ClientGone:
        answer.client_gone(cancel=True)
        return web.Response(status=499)  # nobody reads it: the connection is closed
    except asyncio.CancelledError:
        answer.client_gone(cancel=True)
        raise
    except ApiError as error:  # Redis gone for too long
        answer.abandon(error.message)
        raise
    token_usage = answer.finish(event)
    if event.finish_reason == "error":
        raise request_failed(answer.request_id)
    await answer.read_prompt_logprobs()
    content, tool_calls, finish_reason = answer_parts(answer, event)
    body = final_body(answer.endpoint, answer.request_id, answer.created, answer.model.name, content, finish_reason,
                      token_usage, answer.logprobs_body(), tool_calls=tool_calls)
    with_prompt_logprobs(body, [answer])
    return web.json_response(body)


def with_prompt_logprobs(body: dict, answers: list["Answer"]) -> None:
    """vLLM's prompt_logprobs into a whole answer: each completion choice's, or the chat answer's."""
    if answers[0].prompt_top is None:
        return
    if answers[0].endpoint.is_chat:
        body["prompt_logprobs"] = answers[0].prompt_logprobs_body()
        return
    for choice, answer in zip(body["choices"], answers):
        choice["prompt_logprobs"] = answer.prompt_logprobs_body()


def answer_parts(answer: "Answer", event: TokenEvent) -> tuple[str | None, list[dict], str]:
    """A finished answer's content, tool calls and finish reason (tool_calls when it made calls)."""
    if not answer.tool_format:
        return answer.echo + answer.text, [], event.finish_reason
    parsed = parse_answer(answer.tool_format, answer.text, answer.request_id)
    finish_reason = "tool_calls" if parsed.tool_calls and event.finish_reason == "stop" else event.finish_reason
    return parsed.content, parsed.tool_calls, finish_reason


async def _final_event(request: web.Request, answer: Answer) -> TokenEvent:
    """Collect the output into `answer` until the final event, which it returns."""
    async with aclosing(answer.state.store.follow_tokens(answer.request_id, resubmit=answer.resubmit)) as events:
        async for event in events:
            if event is None:
                if transport_closed(request):
                    raise ClientGone
                continue
            answer.add(event)
            if event.finish_reason is not None:
                return event
    raise AssertionError("follow_tokens ended without a final event")


def request_failed(request_id: str) -> ApiError:
    return ApiError(
        503,
        f"request {request_id} failed in the server; retry",
        error_type="server_error",
        code="request_failed",
    )


async def stream_answer(
    request: web.Request, answer: Answer, include_usage: bool, cancel_on_disconnect: bool
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                 "X-Request-Id": answer.request_id}  # before any token: what to cancel or re-attach to
    )
    try:
        await response.prepare(request)
        await _stream_events(request, response, answer, include_usage)
    except (ClientGone, ConnectionError):
        answer.client_gone(cancel=cancel_on_disconnect)
    except asyncio.CancelledError:
        answer.client_gone(cancel=cancel_on_disconnect)
        raise
    except ApiError as error:  # Redis gone for too long: the headers are sent, so tell the client in-band
        log.warning("stream aborted id=%s error=%s", answer.request_id, error.message)
        answer.abandon(error.message)
        await _write_quietly(response, sse(error.body()) + DONE_EVENT)
    except Exception:
        log.exception("stream failed id=%s", answer.request_id)
        answer.abandon("internal error")
        body = internal_error().body()
        await _write_quietly(response, sse(body) + DONE_EVENT)
    return response


async def _stream_events(
    request: web.Request, response: web.StreamResponse, answer: Answer, include_usage: bool
) -> None:
    chunks = ChunkWriter(answer.endpoint, answer.request_id, answer.created, answer.model.name, include_usage)
    if answer.endpoint.is_chat:
        await response.write(chunks.role())
    echo = answer.echo
    if echo and answer.echo_top < 0:  # (no id: a re-attached stream carries the output only)
        await response.write(chunks.text(echo))
        echo = ""
    last_write = time.monotonic()
    events = answer.state.store.follow_tokens(answer.request_id, answer.start_index, answer.resubmit)
    async with aclosing(events) as events:
        async for event in events:
            if event is None:
                if transport_closed(request):
                    raise ClientGone
                if time.monotonic() - last_write > KEEPALIVE_SECONDS:
                    await response.write(KEEPALIVE_EVENT)
                    last_write = time.monotonic()
                continue
            if echo:  # with its logprobs: those are read at the first token
                await answer.read_prompt_logprobs()
                await response.write(chunks.text(echo, logprobs=answer.echo_logprobs()))
                echo = ""
            answer.add(event)
            if event.finish_reason is None:
                if event.text and not answer.tool_format:  # (an answer that may call tools is read whole)
                    await response.write(chunks.text(event.text, resume_from=event.index + 1,
                                                     logprobs=answer.unsent_logprobs()))
                    last_write = time.monotonic()
                continue
            token_usage = answer.finish(event)  # from here on the request is over: nothing to cancel
            if event.finish_reason == "error":
                await response.write(sse(request_failed(answer.request_id).body()))
            elif answer.tool_format:
                content, tool_calls, finish_reason = answer_parts(answer, event)
                await response.write(chunks.answer(content, tool_calls, finish_reason,
                                                   resume_from=event.index + 1 if event.token_id >= 0 else None,
                                                   logprobs=answer.unsent_logprobs()))
                if include_usage:
                    await response.write(chunks.usage(token_usage))
            else:
                # An end without a token adds none: its chunk carries no id (its index counts the tokens
                # the scheduler applied, which may be fewer than the stream carried: docs/protocol.md)
                await response.write(chunks.text(event.text, event.finish_reason,
                                                 resume_from=event.index + 1 if event.token_id >= 0 else None,
                                                 logprobs=answer.unsent_logprobs()))
                if include_usage:
                    await response.write(chunks.usage(token_usage))
            await response.write(DONE_EVENT)
            await response.write_eof()
            return
    raise AssertionError("follow_tokens ended without a final event")


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    try:
        if response.prepared:
            await response.write(data)
            await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass


async def reattach_stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/requests/{id}/stream?from=N: replay output from index N, then follow it live.

    A re-attached reader is an observer: its going away does not cancel the request.
    """
    state = request.app[STATE]
    request_id = request.match_info["request_id"]
    try:  # `from`, or the SSE standard's Last-Event-ID: a stream's event ids are resume indexes
        start_index = int(request.query.get("from", request.headers.get("Last-Event-ID", "0")))
    except ValueError:
        raise bad_request("`from` must be an integer output index", param="from") from None
    if start_index < 0:
        raise bad_request("`from` must be >= 0", param="from")
    include_usage = request.query.get("include_usage", "false").lower() in ("1", "true", "yes")
    request_state = await state.store.request_state(request_id)
    if request_state is None or not visible_to(request, request_state):
        raise unknown_request(request_id)
    record = request_state.record
    ticket = state.admission.open_stream(request.get(CLIENT_KEY, OPEN_KEY_ID))
    answer = Answer(
        state,
        state.model_of(request_state),
        endpoint_of(request_id),
        request_id,
        int(record.arrival_time) if record else int(time.time()),
        len(record.prompt_token_ids) if record else 0,
        start_index=start_index,
        logprobs=record is not None and record.sampling.logprobs >= 0,
    )
    if request_state.tool_format:
        # An answer that may call tools is read whole and sent as one chunk at its end (none before
        # it carries an id to resume from): a re-attached reader gets it whole, from the start.
        answer.tool_format, answer.start_index = request_state.tool_format, 0
    log.info("re-attached id=%s from=%d status=%s", request_id, start_index, request_state.status)
    try:
        return await stream_answer(request, answer, include_usage, cancel_on_disconnect=False)
    finally:
        ticket.close()
