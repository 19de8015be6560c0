# A build-stage image that installs Python packages from a local wheelhouse instead of an index,
# for building docker/Dockerfile where no index can be reached from inside a build. The build
# context is the wheelhouse itself:
#
#   pip download --dest wheelhouse torch==... ...
#   docker build -f docker/wheelhouse.Dockerfile --build-arg BASE_IMAGE=B -t B-wheels wheelhouse
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=B --build-arg BUILD_IMAGE=B-wheels .
#
# Only the build stage runs on it, so the wheels never reach the trainer image.

ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
COPY . /wheelhouse/
ENV PIP_NO_INDEX=1 \
    PIP_FIND_LINKS=/wheelhouse
