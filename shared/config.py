"""Settings of every service, each readable from an environment variable.

Command-line options (services/cli.py) override the environment; the environment overrides
the defaults here. The variable of a field is ITERSERVE_<FIELD> (REDIS_URL for redis_url).
"""

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MODEL = "smollm2-135m-instruct"


def threads_per_worker(workers: int) -> int:
    """Each worker's share of the machine's cores, so workers don't fight each other."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    redis_url: str = ""  # empty: `iterserve up` starts a private redis-server
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str = DEFAULT_MODEL  # the model's name, or a path to a GGUF file
    # Scheduling
    policy: Literal["iteration", "request"] = "iteration"
    max_batch_size: int = Field(64, ge=1)
    max_batch_tokens: int = Field(512, ge=1)  # token budget of one iteration (prefill chunks)
    # Workers
    workers: int = Field(1, ge=0)  # `iterserve up` only
    kv_blocks: int = Field(2048, ge=1)  # KV blocks per worker
    kv_block_size: int = Field(16, ge=1)
    threads: int = Field(0, ge=0)  # torch threads per worker; 0: cores / workers
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on cuda, f32 on cpu
    attention: Literal["batched", "per_request"] = "batched"
    worker_id: str = ""  # empty: drawn at start
    # Liveness
    heartbeat_seconds: float = Field(0.5, gt=0)
    worker_timeout_seconds: float = Field(2.0, gt=0)  # a worker silent this long is dead
    scheduler_timeout_seconds: float = Field(3.0, gt=0)
    stall_seconds: float = Field(30.0, gt=0)  # /health: no iteration this long while requests wait
    # Gateway
    max_body_bytes: int = Field(1 << 20, ge=1024)
    request_ttl_seconds: int = Field(3600, ge=1)  # how long a finished request stays readable
    log_level: str = "INFO"

    @staticmethod
    def variable(name: str) -> str:
        return "REDIS_URL" if name == "redis_url" else f"ITERSERVE_{name.upper()}"

    def to_env(self) -> dict[str, str]:
        """These settings as environment variables, for child processes."""
        return {self.variable(name): str(value) for name, value in self.model_dump().items()}

    @classmethod
    def from_env(cls, **overrides: object) -> "Settings":
        values: dict[str, object] = {}
        for name in cls.model_fields:
            variable = cls.variable(name)
            if variable in os.environ:
                values[name] = os.environ[variable]
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls.model_validate(values)
