#!/usr/bin/env bash
# The compose cluster run for real on this machine (`make compose-smoke`): builds the CPU
# image, starts deploy/docker-compose.yml, serves chat completions through the published
# port, kills a decode worker under a running stream, checks Prometheus and tears it all
# down. deploy/compose_smoke.py does the work; `--help` lists its options and steps.
#
# This wrapper prepares what the run needs outside the repository:
#   - a tools venv (PDSERVE_SMOKE_TOOLS, default ~/.cache/pdserve-smoke-tools) with the
#     `openai` client and podman-compose;
#   - in the build context, a CPU torch wheel of the image's version from TORCH_WHEEL_DIR
#     (default /opt/wheels, where development machines keep one) and the host's local CA
#     certificates from BUILD_CA_DIR (default /usr/local/share/ca-certificates), for hosts
#     behind a TLS-inspecting proxy. Both are git-ignored and stay out of the final image.
#
# With podman, CONTAINERS_CONF may name a containers.conf for this host (runtime, cgroup
# manager, ulimits: docs/deployment.md has the one this was measured with).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${PDSERVE_SMOKE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-smoke-tools}"
python="${PYTHON:-python3}"
torch_version="$(sed -n 's/^ARG TORCH_VERSION=//p' "$repo/deploy/docker/Dockerfile.cpu")"

for arg in "$@"; do
    if [ "$arg" = -h ] || [ "$arg" = --help ]; then
        exec "$python" "$repo/deploy/compose_smoke.py" --help
    fi
done

if [ ! -x "$tools/bin/podman-compose" ] || ! "$tools/bin/python" -c 'import openai' 2>/dev/null; then
    echo ">> installing the openai client and podman-compose into $tools" >&2
    "$python" -m venv "$tools"
    "$tools/bin/pip" install -q --disable-pip-version-check openai podman-compose
fi

wheels="$repo/deploy/docker/wheels"
if ! compgen -G "$wheels/torch-$torch_version[+-]*.whl" >/dev/null; then
    for wheel in "${TORCH_WHEEL_DIR:-/opt/wheels}"/torch-"$torch_version"+cpu-*.whl; do
        [ -f "$wheel" ] || continue
        echo ">> build context: $wheel" >&2
        ln -f "$wheel" "$wheels/" 2>/dev/null || cp "$wheel" "$wheels/"
        break
    done
fi
for cert in "${BUILD_CA_DIR:-/usr/local/share/ca-certificates}"/*.crt; do
    [ -f "$cert" ] || continue
    if ! cmp -s "$cert" "$repo/deploy/docker/ca-certificates/$(basename "$cert")"; then
        echo ">> build context: CA certificate $cert (build stage only)" >&2
        cp "$cert" "$repo/deploy/docker/ca-certificates/"
    fi
done

cd "$repo"
PATH="$tools/bin:$PATH" exec "$tools/bin/python" deploy/compose_smoke.py "$@"
