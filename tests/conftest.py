import os

import pytest

from tests.redis_server import private_redis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_url():
    with private_redis() as url:
        yield url


@pytest.fixture
async def redis_client(redis_url):
    from shared.redis_connection import connect

    client = connect(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def engine_alone():
    """The oracle of the system tests: the packaged model's engine in this process, one request at a time."""
    from tests.engine_helpers import smollm2_engine_alone

    return smollm2_engine_alone()


@pytest.fixture(scope="module")
def tokenizer():
    """The packaged model's tokenizer (modules with another model define their own)."""
    from shared.tokenizer import Tokenizer

    return Tokenizer.load()
