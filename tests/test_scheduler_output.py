"""The scheduler's streamed text (services/scheduler/output.py) against its specification, token by token.

After each token the stream has sent the request's text up to its earliest stop string (and the
request ends there), or, while none has appeared, all of it but the longest tail that could begin
one. publish_tokens takes a shortcut for most tokens (no search when the piece can neither end nor
begin a stop string): the pieces it sends must be the specification's, whatever the text and the
stop strings.
"""

import random

import redis.asyncio

from services.scheduler.held_results import ResultHolding
from services.scheduler.output import RequestOutputs
from services.scheduler.policy import SchedulerPolicy, TokenOutcome
from services.scheduler.redis_link import RedisLink
from shared.messages import RequestRecord, SamplingParams
from shared.tokenizer import IncrementalDetokenizer, find_stop, held_back_length
from shared.wire import decode_token_event

TEXTS = (
    "The quick brown fox jumps over the lazy dog.\n\nUser: and then?\nAssistant: it sleeps. ### End",
    "Füße, naïve café, crème brûlée; 東京タワー and 😀🎉 emoji; Observation: done\n",
    "def f(x):\n    return x + 1\n\n\nclass A:\n    pass  # END\n</s> trailing words here",
)


def expected_pieces(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> tuple[list[str], int | None]:
    """The specification: each token's piece, and the index of the token that ends on a stop string."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces, emitted = [], 0
    for index, token_id in enumerate(token_ids):
        detokenizer.push(token_id)
        text = detokenizer.text
        found = find_stop(text, stop)
        end = found if found != -1 else len(text) - held_back_length(text, stop)
        pieces.append(text[emitted:end] if end > emitted else "")
        emitted = max(emitted, end)
        if found != -1:
            return pieces, index
    return pieces, None


def streamed_pieces(tokenizer, token_ids: list[int], stop: tuple[str, ...], name: int) -> tuple[list[str], int | None]:
    """What RequestOutputs sends, one result of one token at a time, and the index it ends at."""
    policy = SchedulerPolicy("epoch", context_length=8192, stop_token_ids=tokenizer.stop_token_ids)
    link = RedisLink(redis.asyncio.Redis(), on_write_failed=lambda write, error: None)  # never connects
    outputs = RequestOutputs(tokenizer, policy, link, ResultHolding(False), 3600)
    record = RequestRecord(request_id=f"{name:032x}", prompt_token_ids=(1, 2, 3), arrival_time=0.0,
                           sampling=SamplingParams(max_tokens=len(token_ids) + 1, stop=stop))
    state = policy.add_request(record)
    outputs.start(record, [], 0)
    pieces = []
    for index, token_id in enumerate(token_ids):
        state.output_token_ids.append(token_id)
        outputs.publish_tokens([TokenOutcome(state, token_id, index, None)], "w0")
        assert len(link.tokens) == 1, "one entry per token"
        event = decode_token_event(link.tokens.payloads[0])
        link.tokens.drop(1)
        assert event.index == index and event.token_id == token_id
        pieces.append(event.text)
        if event.finish_reason is not None:
            assert event.finish_reason == "stop"
            return pieces, index
    return pieces, None


def test_streamed_text_with_stop_strings_is_the_specifications_token_by_token(tokenizer):
    rng = random.Random(11)
    cases = 0
    for text in TEXTS:
        token_ids = tokenizer.encode(text)
        for _ in range(40):
            stop = []
            for _ in range(rng.randint(1, 3)):
                kind = rng.random()
                if kind < 0.6:  # a piece of the text: it appears (perhaps across tokens)
                    start = rng.randrange(len(text) - 1)
                    stop.append(text[start:start + rng.randint(1, 8)])
                elif kind < 0.8:  # beginning with a common character, appearing or not
                    stop.append(rng.choice(" \n.e") + rng.choice(("zz", "User:", "\n", "x", "")))
                else:  # never appearing; one is empty
                    stop.append(rng.choice(("\u2603", "", "qqq")))
            stop = tuple(stop)
            assert streamed_pieces(tokenizer, token_ids, stop, cases) == expected_pieces(tokenizer, token_ids, stop), \
                (text, stop)
            cases += 1
    # No stop string: every token's text at once, and the stream is the whole text.
    token_ids = tokenizer.encode(TEXTS[1])
    pieces, ended = streamed_pieces(tokenizer, token_ids, (), cases)
    assert ended is None and "".join(pieces) == TEXTS[1]
