# syntax=docker/dockerfile:1.7
# What the three images (runtime, operator, device plugin) share, built once for all of them:
#   common   python3 with an empty venv in /opt/venv (on PATH), tini, libgomp1 and the
#            unprivileged user kunlun (10001); each image adds its dependencies, labels and USER
#   package  our package as one wheel in /dist (runtime, operator and device plugin), which each
#            image installs with --no-deps after its own pinned dependencies
# scripts/build-images.sh builds both first and hands them to the images as the build arguments
# COMMON_IMAGE and PACKAGE_IMAGE. By hand, from the repository root, before the images:
#   docker build -f images/common.Dockerfile --target common -t ghcr.io/kunlun-inference/kunlun-common:0.1.0 .
#   docker build -f images/common.Dockerfile --target package -t ghcr.io/kunlun-inference/kunlun-package:0.1.0 .
# The base is a build argument (CI passes a Debian base bootstrapped locally): every command here
# is written for it and for python:*-slim alike (apt from the base's own sources).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS common
ARG TINI_VERSION=0.19.0-1+b3
ARG LIBGOMP1_VERSION=12.2.0-14+deb12u1
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini=${TINI_VERSION} libgomp1=${LIBGOMP1_VERSION} \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 kunlun && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kunlun
ARG PIP_VERSION=25.1.1
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir pip==${PIP_VERSION}
ARG PYTHON_IMAGE
LABEL org.opencontainers.image.licenses="Apache-2.0" \
      dev.kunlun.python-image="${PYTHON_IMAGE}"
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Last, so a build without --target gives the wheel.
FROM common AS package
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY device-plugin/ device-plugin/
RUN pip wheel --no-deps --wheel-dir /dist .
