# One image for every fleet process (worker, Flower, producer tools).
# GPU hosts: build with --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY workers workers
COPY producer producer
COPY configs configs
RUN pip install --no-cache-dir ${TORCH_SPEC} && pip install --no-cache-dir ".[worker]"
RUN useradd --create-home fleet
USER fleet
# The workers' traced encoders, stored in the fleet user's trace cache (workers/models/prepare.py):
# a new pod's first start loads them instead of tracing. Key: weights, versions, config, device.
RUN FLEET_CONFIG=/app/configs/fleet.toml fleet prepare
ENTRYPOINT ["fleet"]
