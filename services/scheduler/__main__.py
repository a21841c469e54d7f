"""`python -m services.scheduler`: the scheduler process, configured from the environment."""

import asyncio
import logging

from services.scheduler.service import run_scheduler
from shared.config import Settings


def main() -> None:
    settings = Settings.from_env()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(run_scheduler(settings))
    else:
        uvloop.run(run_scheduler(settings))


if __name__ == "__main__":
    main()
