"""python -m services.gateway: serve the OpenAI-compatible API (settings from the environment)."""

import argparse
import asyncio
import logging
import signal

from services.gateway.app import run_gateway
from shared.config import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    parser.add_argument("--redis-url", help="Redis URL (default: $REDIS_URL)")
    parser.add_argument("--model", help="model name or GGUF path")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    args = parser.parse_args(argv)
    settings = Settings.from_env(
        host=args.host, port=args.port, redis_url=args.redis_url, model=args.model, log_level=args.log_level
    )
    if not settings.redis_url:
        parser.error("no Redis: set REDIS_URL or pass --redis-url (or start everything with `iterserve up`)")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        import uvloop

        run = uvloop.run  # faster Redis round trips
    except ImportError:
        run = asyncio.run
    run(_serve(settings))


async def _serve(settings: Settings) -> None:
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stop_event.set)
    await run_gateway(settings, stop_event)


if __name__ == "__main__":
    main()
