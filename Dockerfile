# The trainer image. CPU by default; `--build-arg JAX_VARIANT=cuda` or `=tpu` pulls the matching jax plugins.
#   docker build -t jaxagent .                               # CPU
#   docker build -t jaxagent:cuda --build-arg JAX_VARIANT=cuda .
# Environment workers have their own image (envs/Dockerfile).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG JAX_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

WORKDIR /opt/jaxagent
COPY pyproject.toml README.md ./
COPY jaxagent ./jaxagent
COPY models ./models
COPY envs ./envs
COPY launch ./launch

RUN case "$JAX_VARIANT" in \
      cpu) extra="" ;; \
      cuda) extra="[cuda]" ;; \
      tpu) extra="[tpu]" ;; \
      *) echo "JAX_VARIANT must be cpu, cuda or tpu, got '$JAX_VARIANT'" >&2; exit 1 ;; \
    esac \
    && pip install ".${extra}"

RUN useradd --create-home --uid 1000 jaxagent
USER jaxagent
WORKDIR /home/jaxagent
ENTRYPOINT ["jaxagent"]
CMD ["--help"]
