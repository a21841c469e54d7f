"""`iterserve`: one console script for the whole system and for each service.

  iterserve up          redis (private, unless --redis-url), gateway, scheduler, N workers
  iterserve serve MODEL up, as vLLM's `vllm serve MODEL [options]` is written
  iterserve gateway     the HTTP front door        (one process, as compose runs it)
  iterserve scheduler   the iteration-level scheduler
  iterserve worker      one worker: model + KV cache
  iterserve bench       the load generator (see services/bench)
  iterserve keep-awake  spin at idle priority: keeps a scheduler's CPU from idling (services/keep_awake.py)

Every option can also come from the environment (ITERSERVE_<OPTION>, REDIS_URL) or a config file
(`--config FILE`: YAML, its keys the options' names); the command line wins over the file, the file
over the environment. vLLM's names for the options vLLM has are accepted beside ours
(VLLM_OPTIONS: `--tensor-parallel-size`, `--max-num-seqs`, `--gpu-memory-utilization`, ...).
"""

import argparse
import json
import asyncio
import logging
import signal
import sys

from shared.config import REQUEST_LOG, Settings

SERVICE_OPTIONS = {
    # option: (settings field, type, help)
    "--redis-url": ("redis_url", str, "Redis URL, e.g. redis://:password@host:6379/0, or through Sentinels "
                                      "redis+sentinel://host:26379,host2:26379,host3:26379/primary-name (rediss+sentinel://"
                                      "...?ssl_ca_certs=PATH: TLS) (env REDIS_URL)"),
    "--redis-replicas": ("redis_replicas", int, "up: replicas of its own Redis, and three Sentinels that promote "
                                                "one when the primary is lost (default 0)"),
    "--redis-wait-replicas": ("redis_wait_replicas", int, "gateway: accept a request once this many Redis replicas "
                                                          "hold it (WAIT; default 0, up --redis-replicas N: 1)"),
    "--redis-wait-ms": ("redis_wait_ms", int, "gateway: how long acceptance waits for the replicas (default 1000)"),
    "--host": ("host", str, "gateway bind address (default 127.0.0.1)"),
    "--port": ("port", int, "gateway port (default 8000)"),
    "--model": ("model", str, "model name, path to a GGUF file, or a Hugging Face checkpoint directory "
                          "(default: SmolLM2-135M-Instruct); up and gateway: once per model to serve several"),
    "--served-model-name": ("served_model_name", str, "the model's name in the API, once per --model (default: "
                                                      "the file's or directory's name)"),
    "--policy": ("policy", str, "iteration (Orca) or request (FasterTransformer-style baseline)"),
    "--request-results": ("request_results", str,
                          "policy request: batch (results when the whole batch is done, as in Orca's baseline) or stream"),
    "--max-batch-size": ("max_batch_size", int, "requests per iteration per worker (default 64)"),
    "--max-batch-tokens": ("max_batch_tokens", int, "token budget per iteration per worker (default 512)"),
    "--pipeline-depth": ("pipeline_depth", int, "plans in flight per worker (default 2: the next is planned while one runs)"),
    "--answer-every": ("answer_every", int, "plans a worker answers with one result write, sent together (default 1; "
                                            "K > 1 needs --pipeline-depth 2K: fewer scheduler round trips, K-1 steps later)"),
    "--scheduler-steps": ("scheduler_steps", int, "decode steps one plan runs, answered together (default 1; N > 1: "
                                                  "the scheduler plans once per N steps, a request joins up to N later)"),
    "--scheduler-plan-ms": ("scheduler_plan_ms", float, "with --scheduler-steps N: a worker's plans run as many "
                                                        "steps (up to N) as fit in this many ms of its measured steps"),
    "--speculative-config": ("speculative_config", str, "vLLM's speculative decoding JSON, e.g. '{\"method\": "
                                                        "\"ngram\", \"num_speculative_tokens\": 4, "
                                                        "\"prompt_lookup_max\": 4}' (default: none)"),
    "--scheduler-token-entries": ("worker_token_entries", "off", "the scheduler writes every token entry (default: "
                                                              "workers write those of tokens that end nothing)"),
    "--no-prefix-caching": ("prefix_caching", "off", "recompute every prompt (default: finished requests' KV blocks "
                                                   "stay cached for later requests with the same prefix)"),
    "--placement": ("placement", str, "cache-aware (default: the worker holding the longest prefix, within "
                                      "--placement-slack of the least loaded) or least-loaded (the fewest running)"),
    "--placement-slack": ("placement_slack", int, "cache-aware placement: requests a worker may run beyond the "
                                                  "least loaded one's and still get a request for its cache (default 8)"),
    "--placement-threshold": ("placement_threshold", float, "cache-aware placement: the fraction of a request's "
                                                            "tokens a worker must hold to get it for its cache (0.5)"),
    "--kv-blocks": ("kv_blocks", int, "KV cache blocks per worker (default 2048)"),
    "--kv-memory-fraction": ("kv_memory_fraction", float, "size the KV pool as this fraction of free device memory"),
    "--kv-block-size": ("kv_block_size", int, "tokens per KV block (default 16)"),
    "--workers": ("workers", int, "workers started by `up` (default 1)"),
    "--tensor-parallel": ("tensor_parallel", int, "ranks per worker, each holding 1/N of every layer (default 1)"),
    "--pipeline-parallel": ("pipeline_parallel", int, "stages per worker, each holding 1/M of the layers (default 1)"),
    "--threads": ("threads", int, "torch threads per worker (default: cores / workers)"),
    "--device": ("device", str, "auto, cpu, cuda, cuda:1 ... (default auto)"),
    "--dtype": ("dtype", str, "auto, float32, bfloat16, float16 (default: bf16 on CUDA, f32 on CPU)"),
    "--quantization": ("quantization", str, "gguf: keep a GGUF's Q4_*/Q5_*/Q8_0 tensors packed (CPU; bfloat16 "
                                            "unless --dtype says otherwise); none (default): dequantize at load"),
    "--attention": ("attention", str, "batched or per_request (Orca's reference path)"),
    "--compile": ("compile", bool, "torch.compile the flattened non-attention ops of each step"),
    "--cuda-graphs": ("cuda_graphs", bool, "CUDA: replay decode-only steps from CUDA graphs (bucketed sizes)"),
    "--executor": ("executor", str, "engine (the model) or emulated (a benchmarking instrument: no model, steps "
                                    "take a hardware profile's time)"),
    "--hardware": ("hardware", str, "--executor emulated: a profile name in profiles/ or a path to one"),
    "--decode-workspace-tokens": ("decode_workspace_tokens", int,
                                  "contiguous decode KV kept across steps, in tokens (default 65536; 0: off)"),
    "--worker-id": ("worker_id", str, "this worker's id (default: drawn at start)"),
    "--log-level": ("log_level", str, "DEBUG, INFO, WARNING ..."),
    "--log-requests": ("log_requests", bool, "the scheduler logs each request's admission and end (default: "
                                             "only the gateways log requests, at their end)"),
    "--schedulers": ("schedulers", int, "schedulers per model, each leasing a shard of its workers and taking "
                                        "over those of one that dies or stalls (default 1)"),
    "--scheduler-lease-ms": ("scheduler_lease_ms", int, "--schedulers N: how long a scheduler's leases last "
                                                        "unrenewed, the longest wait before a takeover (default 2000)"),
    "--scheduler-cpus": ("scheduler_cpus", str, "up: CPUs the scheduler runs on alone, kept from idling (a CPU "
                                                "list: 3 or 2-3); everything else runs on the others (default: "
                                                "no pinning)"),
    # Access and admission (services/gateway/admission.py)
    "--api-keys": ("api_keys", str, "comma-separated API keys (visible in ps: prefer --api-keys-file or the env)"),
    "--api-keys-file": ("api_keys_file", str, "file of API keys, one per line"),
    "--protect-observability": ("protect_observability", bool, "/metrics and /status need an API key too"),
    "--max-waiting-requests": ("max_waiting_requests", int, "429 past this many waiting requests (default 512)"),
    "--max-waiting-prompt-tokens": ("max_waiting_prompt_tokens", int, "429 past this many waiting prompt tokens"),
    "--max-streams-per-key": ("max_streams_per_key", int, "open generation requests per API key (default 128)"),
    "--max-prompt-tokens": ("max_prompt_tokens", int, "prompt tokens per request (default: the context length)"),
    "--max-tokens-limit": ("max_tokens_limit", int, "max_tokens per request (default: the context length)"),
    "--max-stop-strings": ("max_stop_strings", int, "stop strings per request (default 4)"),
    "--max-stop-length": ("max_stop_length", int, "characters per stop string (default 256)"),
}


LIST_OPTIONS = ("model", "served_model_name")

# vLLM's names for what iterserve also does (an operator's `vllm serve` line works unchanged):
# option strings -> (settings field, type, help). Options with a value take it as ours do.
VLLM_OPTIONS = {
    ("--tensor-parallel-size", "-tp"): ("tensor_parallel", int, "vLLM's name for --tensor-parallel"),
    ("--pipeline-parallel-size", "-pp"): ("pipeline_parallel", int, "vLLM's name for --pipeline-parallel"),
    ("--max-num-seqs",): ("max_batch_size", int, "vLLM's name for --max-batch-size"),
    ("--max-num-batched-tokens",): ("max_batch_tokens", int, "vLLM's name for --max-batch-tokens"),
    ("--block-size",): ("kv_block_size", int, "vLLM's name for --kv-block-size"),
    ("--gpu-memory-utilization",): ("gpu_memory_utilization", float,
                                    "the share of the device's whole memory a worker may take, weights and KV "
                                    "together (vLLM's meaning; the KV pool is what the weights leave)"),
    ("--max-model-len",): ("max_model_len", int, "serve at most this many tokens a request (prompt and output)"),
    ("--enforce-eager",): ("enforce_eager", bool, "every step eager: no CUDA graphs, no --compile"),
    ("--tokenizer",): ("tokenizer", str, "another model's tokenizer (a checkpoint directory or a GGUF)"),
    ("--chat-template",): ("chat_template", str, "a chat template (a file, or the template itself) in place of "
                                                 "the model's"),
}


def add_service_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a YAML file of options (keys: the options' names, with or without --; "
                                         "the command line wins over it, it over the environment)")
    for options, (field, kind, help_text) in VLLM_OPTIONS.items():
        if kind is bool:
            parser.add_argument(*options, dest=field, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(*options, dest=field, type=kind, default=None, help=help_text)
    parser.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_const", const=True,
                        default=None, help="vLLM's name: prefix caching on (the default)")
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_const", const=False,
                        help="vLLM's name for --no-prefix-caching")
    parser.add_argument("--api-key", dest="api_key", action="append", default=None,
                        help="an API key (vLLM's name; repeatable, adding to --api-keys and --api-keys-file)")
    for option, (field, kind, help_text) in SERVICE_OPTIONS.items():
        if kind is bool:
            parser.add_argument(option, dest=field, action="store_true", default=None, help=help_text)
        elif kind == "off":  # a flag that turns off what is on by default
            parser.add_argument(option, dest=field, action="store_false", default=None, help=help_text)
        elif field in LIST_OPTIONS:  # given once per model: `--model A --model B`
            parser.add_argument(option, dest=field, type=kind, action="append", default=None, help=help_text)
        else:
            parser.add_argument(option, dest=field, type=kind, default=None, help=help_text)


def settings_from(args: argparse.Namespace) -> Settings:
    """The command line's settings over the config file's (--config) over the environment's."""
    fields = {field for field, _, _ in SERVICE_OPTIONS.values()} | {field for field, _, _ in VLLM_OPTIONS.values()}
    values = {field: getattr(args, field, None) for field in fields | {"prefix_caching"}}
    for field in LIST_OPTIONS:
        if values[field] is not None:
            values[field] = ",".join(values[field])
    if getattr(args, "api_key", None):  # --api-key adds to the keys --api-keys gives
        values["api_keys"] = ",".join(filter(None, [values.get("api_keys") or "", *args.api_key]))
    config = config_file_values(args.config) if getattr(args, "config", None) else {}
    return Settings.from_env(**(config | {field: value for field, value in values.items() if value is not None}))


def config_file_values(path: str) -> dict[str, object]:
    """A config file's settings: a YAML mapping whose keys are the options' names (`max-num-seqs`,
    `--max-num-seqs`, `max_num_seqs`; ours or vLLM's). Raises ValueError naming what it cannot take."""
    import yaml

    try:
        with open(path) as file:
            raw = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: not a mapping of options to values")
    by_option = {option: (field, kind) for option, (field, kind, _) in SERVICE_OPTIONS.items()}
    by_option |= {option: (field, kind) for options, (field, kind, _) in VLLM_OPTIONS.items() for option in options}
    by_option |= {"--enable-prefix-caching": ("prefix_caching", bool), "--api-key": ("api_key", "list"),
                  "--no-enable-prefix-caching": ("prefix_caching", "off")}
    values: dict[str, object] = {}
    for key, value in raw.items():
        option = "--" + str(key).lstrip("-").replace("_", "-")
        if option not in by_option:
            raise ValueError(f"--config {path}: unknown option {key!r}")
        field, kind = by_option[option]
        if kind == "off":  # (no-prefix-caching: true turns it off)
            value = not value
        if isinstance(value, list):
            value = ",".join(str(item) for item in value)
        if isinstance(value, dict):  # (speculative-config as a YAML mapping, as vLLM's config files write it)
            value = json.dumps(value)
        values[field] = str(value) if field in ("api_key", "api_keys") else value
    if "api_key" in values:  # api-key adds to the file's api-keys, as on the command line
        values["api_keys"] = ",".join(filter(None, [values.get("api_keys", ""), values.pop("api_key")]))
    return values


def configure_logging(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The scheduler's request lines (INFO): off unless asked for, whatever the level.
    logging.getLogger(REQUEST_LOG).setLevel(logging.NOTSET if settings.log_requests else logging.WARNING)


def serve(run_service, settings: Settings) -> None:
    """Run one service's `run_*(settings, stop_event)` until SIGTERM or SIGINT."""

    async def until_signal() -> None:
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signal_number, stop_event.set)
        await run_service(settings, stop_event)

    try:
        import uvloop
    except ImportError:
        asyncio.run(until_signal())
    else:
        uvloop.run(until_signal())


def require_redis(settings: Settings, parser: argparse.ArgumentParser) -> None:
    if not settings.redis_url:
        parser.error("no Redis: pass --redis-url or set REDIS_URL (or start everything with `iterserve up`)")
    from shared.redis_connection import credentials_error

    problem = credentials_error(settings.redis_url)  # a wrong password stops here, not in a retry loop
    if problem:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")


def require_model(settings: Settings, command: str, parser: argparse.ArgumentParser) -> None:
    """A missing or unservable model (file, directory, architecture, tensor type, tokenizer) stops
    every service at start with one line saying what was found and what is supported."""
    from shared.model_file import ModelFileError
    from shared.served_models import served_models

    try:
        models = served_models(settings)
    except ModelFileError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if len(models) > 1 and command in ("scheduler", "worker"):
        parser.exit(2, f"{parser.prog}: error: a {command} serves one model; start one per model, each with its "
                       "--model, --served-model-name and ITERSERVE_MODEL_GROUP (`iterserve up` does)\n")
    if (settings.tokenizer or settings.chat_template) and len(models) > 1:
        parser.exit(2, f"{parser.prog}: error: --tokenizer and --chat-template replace one model's: give them with "
                       "one --model\n")
    if settings.max_model_len:
        from shared.model_file import load_metadata

        for served in models:
            context = load_metadata(served.path).config.context_length
            if settings.max_model_len > context:
                parser.exit(2, f"{parser.prog}: error: --max-model-len {settings.max_model_len} exceeds the context "
                               f"length of {served.name} ({context})\n")
    if settings.tokenizer:
        from shared.model_file import load_metadata

        try:
            load_metadata(settings.tokenizer)
        except (ModelFileError, OSError, ValueError) as error:
            parser.exit(2, f"{parser.prog}: error: --tokenizer {settings.tokenizer}: {error}\n")
    from shared.speculative import parse_speculative_config

    speculative = parse_speculative_config(settings.speculative_config)  # (Settings has checked the JSON)
    if speculative is not None and speculative.proposed_by_worker:
        from shared.model_file import load_metadata, serving_config
        from shared.speculative import draft_model_problem

        for served in models:
            context = serving_config(load_metadata(served.path).config, settings.max_model_len).context_length
            if problem := draft_model_problem(speculative.model, served.path, context, speculative.draft_packed,
                                              settings.tokenizer):
                parser.exit(2, f"{parser.prog}: error: {problem}\n")
    if settings.chat_template:
        from shared.tokenizer import compile_chat_template, read_chat_template

        try:
            compile_chat_template(read_chat_template(settings.chat_template))
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        except Exception as error:  # jinja2's TemplateSyntaxError: the template does not compile
            parser.exit(2, f"{parser.prog}: error: --chat-template: {type(error).__name__}: {error}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "gateway", "scheduler", "worker"):
        add_service_options(commands.add_parser(name, help=f"run {name}"))
    vllm_serve = commands.add_parser("serve", help="`vllm serve MODEL ...` as vLLM takes it: up, its model first")
    vllm_serve.add_argument("model_tag", nargs="?", help="the model (as --model)")
    add_service_options(vllm_serve)
    commands.add_parser("keep-awake", help="spin at idle priority, keeping this CPU from idling (run it pinned to "
                                           "the scheduler's CPU: services/keep_awake.py)")
    bench = commands.add_parser("bench", help="load generator against a running gateway", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # REMAINDER would refuse options that come first (`bench --rate 2`)
        from services.bench.cli import main as bench_main

        bench_main(argv[1:])
        return
    args = parser.parse_args(argv)

    if args.command == "bench":
        from services.bench.cli import main as bench_main

        bench_main(args.bench_args)
        return
    if args.command == "keep-awake":
        from services.keep_awake import main as keep_awake

        keep_awake()
        return
    if args.command == "serve":  # vLLM's command line: the model first, then the options
        args.command = "up"
        if args.model_tag:
            args.model = [args.model_tag, *(args.model or [])]
    try:
        settings = settings_from(args)
    except ValueError as error:  # a config file it cannot take, or settings that do not validate
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    configure_logging(settings)
    require_model(settings, args.command, parser)
    if args.command == "up":
        from services.launcher import run_up

        sys.exit(run_up(settings))
    require_redis(settings, parser)
    if args.command == "gateway":
        from services.gateway.app import run_gateway

        serve(run_gateway, settings)
    elif args.command == "scheduler":
        from services.scheduler.service import run_scheduler

        serve(run_scheduler, settings)
    elif args.command == "worker":
        from services.worker.service import run_worker

        serve(run_worker, settings)


if __name__ == "__main__":
    main()
