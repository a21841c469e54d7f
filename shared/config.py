"""Settings of every service, each readable from an environment variable.

Command-line options (services/cli.py) override the environment; the environment overrides
the defaults here. The variable of a field is ITERSERVE_<FIELD> (REDIS_URL for redis_url).
"""

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.model_file import DEFAULT_MODEL  # re-exported: the settings' default
from shared.speculative import parse_speculative_config


def executor_label(settings: "Settings") -> str:
    """The executor as start lines and reports name it: "engine" (the model runs), or
    "EMULATED:<profile>" (no model runs: steps take a hardware profile's time)."""
    return "engine" if settings.executor == "engine" else f"EMULATED:{settings.hardware or '?'}"


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Each worker's share of the machine's cores (or of `cores` of them), so workers don't fight each other."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, workers))


MAX_CPUS = 8192  # (Linux's own most, NR_CPUS)


def cpu_list(text: str) -> frozenset[int]:
    """A CPU list as taskset and cgroups write it ("0", "0,2", "0-3,6"), as CPU numbers; "" is none."""
    cpus: set[int] = set()
    for part in filter(None, (part.strip() for part in text.split(","))):
        first, dash, last = part.partition("-")
        if (not first.isdigit() or (dash and not last.isdigit()) or int(last or first) < int(first)
                or int(last or first) >= MAX_CPUS):
            raise ValueError(f"not a CPU list: {text!r} (CPU numbers below {MAX_CPUS} and ranges of them, such as "
                             "0 or 0,2 or 0-3)")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def cpu_text(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


# The logger of the scheduler's per-request lines (admitted, finished): Settings.log_requests.
REQUEST_LOG = "iterserve.scheduler.requests"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    redis_url: str = ""  # empty: `iterserve up` starts a private redis-server
    # `iterserve up` with its own Redis: this many replicas of it and three Sentinels that promote
    # one when the primary is lost (every service connects through them: shared/redis_connection.py)
    redis_replicas: int = Field(0, ge=0, le=4)
    # The gateway accepts a request once this many replicas hold it (Redis's WAIT), or after
    # redis_wait_ms without them (counted in iterserve_acceptance_unreplicated_total: docs/operations.md)
    redis_wait_replicas: int = Field(0, ge=0, le=4)
    redis_wait_ms: int = Field(1000, ge=1, le=60_000)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # The packaged model's name, a GGUF file, or a checkpoint directory; several comma-separated for
    # `up` and the gateway (shared/served_models.py).
    model: str = DEFAULT_MODEL
    served_model_name: str = ""  # the model's name in the API (one per model); empty: the file's or directory's name
    model_group: str = ""  # scheduler and worker of a deployment of several models: their model's group of keys
    # Scheduling
    policy: Literal["iteration", "request"] = "iteration"
    # Policy "request" only: "batch" returns a batch's results together once the whole batch is
    # done (Orca's request-level baseline, FasterTransformer's behaviour); "stream" streams each
    # token as it is sampled (a stronger baseline: early-finished requests return at once).
    request_results: Literal["batch", "stream"] = "batch"
    max_batch_size: int = Field(64, ge=1)
    max_batch_tokens: int = Field(512, ge=1)  # token budget of one iteration (prefill chunks)
    # Plans in flight per worker: 2 plans iteration k+1 while k runs (Orca's pipelining); 1 waits.
    pipeline_depth: int = Field(2, ge=1, le=8)
    # Plans a worker answers with one result write (and the scheduler reads with one round trip):
    # the scheduler sends them together and the worker holds the first results for the last one's.
    # 1 (the default): every plan is answered as it ends. K > 1 takes the scheduler's Redis round
    # trips per worker-iteration to 1/K for fleets of few workers, for a token latency up to K - 1
    # steps longer and a new request joining up to K steps later; it needs pipeline_depth >= 2K (a
    # group runs while the next is planned). Workers of several pipeline stages answer each plan.
    answer_every: int = Field(1, ge=1, le=4)
    # Decode steps one plan may run (vLLM v0's --num-scheduler-steps): a plan whose every item
    # samples a token (decodes) is run that many times over by its worker, each step feeding the
    # token the step before sampled, and answered with one result write, one result per step. The
    # scheduler plans, encodes and reads once per N steps, not once per step, for a new request
    # joining up to N steps later and a finished one's KV freed up to N - 1 steps later (the tokens
    # sampled past a stop token or a cancel are dropped). 1 (the default): Orca's one plan per step.
    # Not with answer_every > 1 (two ways of answering several steps at once).
    scheduler_steps: int = Field(1, ge=1, le=16)
    # With scheduler_steps > 1: a worker's plans run as many steps as fit in this many milliseconds
    # of its own measured steps (at most scheduler_steps, at least 1), so one setting serves workers
    # of any speed: one step a plan for this CPU's 60-300 ms steps, up to 7 for a GPU's 3.4 ms at 25.
    # A worker runs one step a plan until its first answer says how long its steps take. 0 (the
    # default): every plan of decodes runs scheduler_steps.
    scheduler_plan_ms: float = Field(0.0, ge=0, le=10_000)
    # vLLM's --speculative-config JSON (shared/speculative.py): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b,
    # "disable_by_batch_size": n}. The scheduler proposes up to k tokens per request from its prompt
    # and output (prompt lookup) while a worker runs at most n requests, and the worker verifies them
    # in one step: the same tokens as without it. Empty (the default): no speculation.
    speculative_config: str = ""
    # Workers write the token entries of tokens that end nothing, of requests without stop strings or
    # logprobs under the iteration policy (docs/protocol.md); False: the scheduler writes them all.
    worker_token_entries: bool = True
    # Prefix caching (services/scheduler/prefix_cache.py): finished requests' full KV blocks stay on
    # their worker for later requests with the same prefix (a conversation's next turn, a shared
    # system prompt) until the room is needed.
    prefix_caching: bool = True
    # Where a waiting request goes: "cache-aware", the worker holding the longest prefix of it when
    # that prefix is at least placement_threshold of the request's tokens, unless that worker runs
    # more than placement_slack requests more than the least loaded one; "least-loaded", the worker
    # running the fewest requests (services/scheduler/placement.py).
    placement: Literal["cache-aware", "least-loaded"] = "cache-aware"
    placement_slack: int = Field(8, ge=0)
    placement_threshold: float = Field(0.5, ge=0.0, le=1.0)
    # Workers
    workers: int = Field(1, ge=0)  # `iterserve up` only
    # A worker group (services/worker/group.py) of tensor_parallel x pipeline_parallel ranks: each
    # stage holds a run of layers, each of its ranks 1/tensor_parallel of every one of them; the
    # scheduler sees one worker with the group's KV capacity.
    tensor_parallel: int = Field(1, ge=1, le=64)
    pipeline_parallel: int = Field(1, ge=1, le=64)
    kv_blocks: int = Field(2048, ge=1)  # KV blocks per worker
    # When > 0, size the KV pool as this fraction of the device's free memory instead of kv_blocks.
    kv_memory_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # vLLM's --gpu-memory-utilization: when > 0, the share of the device's whole memory the worker may
    # take, weights, activations and KV together; the KV pool is what the worker's own weights and
    # largest step's activations leave of it (on the CPU, of the machine's memory), counted from the
    # model's shape (services/worker/engine.py own_bytes) rather than profiled as vLLM does.
    gpu_memory_utilization: float = Field(0.0, ge=0.0, le=1.0)
    # vLLM's --max-model-len: serve at most this many tokens a request (prompt and output), below the
    # model's own context length; 0: the model's.
    max_model_len: int = Field(0, ge=0)
    kv_block_size: int = Field(16, ge=1)
    threads: int = Field(0, ge=0)  # torch threads per worker; 0: cores / workers
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on cuda, f32 on cpu
    # vLLM's --quantization: "gguf" keeps a GGUF's Q4_0/1/K, Q5_0/1/K and Q8_0 tensors packed in memory
    # and multiplies them by torch's dequantizing int4 kernel, or on AVX2 hosts the project's own
    # (services/worker/quantized.py, cpu_kernels.py; on the CPU, a worker of one process), computing in
    # bfloat16 (float32 with the project's kernel) unless dtype says otherwise; "none" (the default)
    # dequantizes every tensor to the dtype at load.
    quantization: Literal["none", "gguf"] = "none"
    attention: Literal["batched", "per_request"] = "batched"
    # torch.compile the non-attention ops of a step (the token count dynamic): fewer, fused ops; the
    # first steps of each new shape class take seconds to compile.
    compile: bool = False
    # CUDA only: decode-only steps padded to bucketed sizes and replayed from captured CUDA graphs.
    cuda_graphs: bool = False
    # vLLM's --enforce-eager: every step eager, whatever cuda_graphs and compile say.
    enforce_eager: bool = False
    # vLLM's --tokenizer and --chat-template: another model's tokenizer (a checkpoint directory or a
    # GGUF) and a chat template (a file, or the template itself) in place of the model's own.
    tokenizer: str = ""
    chat_template: str = ""
    # "emulated": no model, steps take the time a hardware profile's roofline gives (a benchmarking
    # instrument for the control plane; services/worker/emulated.py). Never the default.
    executor: Literal["engine", "emulated"] = "engine"
    hardware: str = ""  # the emulated executor's profile: a name in profiles/ or a path
    # Batched attention keeps decoding requests' KV in contiguous rows across steps (no gather
    # per step); at most this many tokens (rows x context; 46 KB each for SmolLM2 in float32).
    # 0: gather from the paged pool at every step.
    decode_workspace_tokens: int = Field(65536, ge=0)
    worker_id: str = ""  # empty: drawn at start
    # Liveness
    heartbeat_seconds: float = Field(0.5, gt=0)
    # A worker silent this long is dead: with the scheduler's poll (every 0.25 s) a killed worker
    # is noticed within 1.75 s.
    worker_timeout_seconds: float = Field(1.5, gt=0)
    scheduler_timeout_seconds: float = Field(3.0, gt=0)
    # Schedulers per model (docs/scaling.md, "Shards of workers"): 1 (the default) plans every
    # worker of the model; N > 1 run side by side, each holding leases on a shard of the workers and
    # owning the requests it took, taking over those of one whose lease ran out (scheduler_lease_ms).
    schedulers: int = Field(1, ge=1, le=64)
    # How long a scheduler's leases (on itself and on its workers) last unless renewed (every poll,
    # a quarter second): a scheduler dead or stalled this long is taken over.
    scheduler_lease_ms: int = Field(2000, ge=500, le=60000)
    stall_seconds: float = Field(30.0, gt=0)  # /health: no iteration this long while requests wait
    # SIGTERM'd worker: takes no new requests, hands its running ones over (or finishes them),
    # and exits after at most this long (compose and `up` give a stopping service 10 s and 15 s).
    drain_seconds: float = Field(8.0, ge=0)
    # Gateway
    max_body_bytes: int = Field(1 << 20, ge=1024)
    request_ttl_seconds: int = Field(3600, ge=1)  # how long a finished request stays readable
    # Scheduler: the last this many IterationRecords stay in Redis (observability, tests, the
    # benchmarks' timelines); about 2.7 KB each at batch 64. 0 writes none.
    iteration_records: int = Field(1000, ge=0)
    # Access (services/gateway/admission.py): with no key configured the API is open to anyone
    # who can reach host:port (the default host is 127.0.0.1 for that reason).
    api_keys: str = ""  # comma-separated keys; `Authorization: Bearer <key>` on every /v1/* request
    api_keys_file: str = ""  # one key per line (blank lines and # comments ignored)
    protect_observability: bool = False  # /metrics and /status need a key too
    # Admission: past these the gateway answers 429 with Retry-After instead of queueing.
    max_waiting_requests: int = Field(512, ge=1)  # requests accepted, no output token yet
    max_waiting_prompt_tokens: int = Field(262_144, ge=1)  # their prompt tokens
    max_streams_per_key: int = Field(128, ge=1)  # open generation responses (streamed or not) per key
    # Limits on what one request may ask for (400 past them); 0: the model's context length.
    max_prompt_tokens: int = Field(0, ge=0)
    max_tokens_limit: int = Field(0, ge=0)
    max_stop_strings: int = Field(4, ge=0)
    max_stop_length: int = Field(256, ge=1)  # characters of one stop string
    log_level: str = "INFO"
    # The scheduler logs each request's admission and end (at INFO; the gateways log every
    # request's end regardless). Off by default, as vLLM's --enable-log-requests: the lines are the
    # one scheduler's CPU, a quarter of its fan-out at batch 64 with few fast workers
    # (measured 2026-12-03: benchmarks/results/control_plane_2026-12-03_request_lines.md in git history).
    log_requests: bool = False
    # `iterserve up` only: CPUs the scheduler runs on alone (a CPU list: "3", "2-3"); the workers,
    # the gateway and the private Redis run on the machine's others, and an idle-priority process
    # per scheduler CPU keeps it from going idle between results (services/keep_awake.py: an idle core
    # makes the scheduler's next turn about twice as costly). Empty (the default): no pinning.
    scheduler_cpus: str = ""

    @model_validator(mode="after")
    def _depth_holds_two_groups(self) -> "Settings":
        if self.gpu_memory_utilization and self.group_size > 1:
            raise ValueError("gpu_memory_utilization sizes a worker's pool after its weights are loaded, which a "
                             "worker group's ranks do at different times: use kv_memory_fraction with a group")
        if self.pipeline_depth < 2 * self.answer_every and self.answer_every > 1:
            raise ValueError(f"answer_every {self.answer_every} needs pipeline_depth at least "
                             f"{2 * self.answer_every} (a group of plans runs while the next is planned), "
                             f"not {self.pipeline_depth}")
        if self.scheduler_plan_ms and self.scheduler_steps == 1:
            raise ValueError(f"scheduler_plan_ms {self.scheduler_plan_ms} needs scheduler_steps above 1 "
                             "(the most steps a plan may run)")
        scheduler_cpus = cpu_list(self.scheduler_cpus)  # (a ValueError names what is wrong)
        if self.schedulers > 1 and scheduler_cpus and len(scheduler_cpus) < self.schedulers:
            raise ValueError(f"schedulers {self.schedulers} with scheduler_cpus {self.scheduler_cpus}: each scheduler "
                             f"gets its own CPUs from the list, which names {len(scheduler_cpus)}")
        if self.schedulers > 1 and self.policy != "iteration":
            raise ValueError(f"schedulers {self.schedulers} needs the iteration policy (a request-level batch is "
                             "held whole by the one scheduler that formed it)")
        speculative = parse_speculative_config(self.speculative_config)  # (as does this)
        if speculative is not None and self.policy != "iteration":
            raise ValueError("speculative_config needs the iteration policy (a request-level batch runs to its end)")
        if speculative is not None and self.executor == "emulated":
            raise ValueError("speculative_config: the emulated executor runs no model, so it verifies no proposal")
        if speculative is not None and speculative.proposed_by_worker and self.group_size > 1:
            raise ValueError("speculative_config: a draft model runs in one worker process: not with "
                             "tensor_parallel or pipeline_parallel")
        if self.quantization == "gguf" and self.group_size > 1:
            raise ValueError("quantization gguf runs in one worker process: not with tensor_parallel or "
                             "pipeline_parallel")
        if self.quantization == "gguf" and self.compile:
            raise ValueError("quantization gguf runs its projections eagerly: not with compile")
        if self.scheduler_steps > 1 and self.answer_every > 1:
            raise ValueError(f"scheduler_steps {self.scheduler_steps} and answer_every {self.answer_every}: "
                             "choose one (each answers several steps with one write)")
        return self

    @property
    def group_size(self) -> int:
        """Processes (ranks) per worker."""
        return self.tensor_parallel * self.pipeline_parallel

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
