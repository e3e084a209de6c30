#!/usr/bin/env bash
# Base images made from Debian packages alone, for hosts that reach a Debian mirror but no
# container registry. Each is a Debian root file system built by mmdebstrap and imported by
# the container engine; the compose file and the Dockerfiles take them through variables:
#
#   deploy/docker/make-base.sh                      # all three, with podman or docker
#   PYTHON_IMAGE=localhost/pdserve-base:bookworm \
#   REDIS_IMAGE=localhost/pdserve-redis:bookworm \
#   PROMETHEUS_IMAGE=localhost/pdserve-prometheus:bookworm \
#       podman-compose -f deploy/docker-compose.yml up --build
#
#   base        python3 (3.11 on bookworm) with venv, tini, CA certificates: the Dockerfiles'
#               PYTHON_IMAGE build argument (python:3.11-slim-bookworm has the same layout)
#   redis       redis-server and redis-cli: the compose file's REDIS_IMAGE
#   prometheus  Debian's prometheus, entry point and storage as in prom/prometheus: the
#               compose file's PROMETHEUS_IMAGE
#
# A user with access to Docker Hub needs none of this: the defaults are the official images.
# Needs root (mmdebstrap unpacks as root here) and the mmdebstrap package.
set -euo pipefail

usage() {
    cat <<EOF
usage: $0 [--engine podman|docker] [--suite SUITE] [--mirror URL] [--tag TAG] [IMAGE...]

Builds localhost/pdserve-IMAGE:TAG for each IMAGE of: base redis prometheus (default: all).
  --engine   the container engine that imports the file system (default: podman if
             installed, else docker)
  --suite    Debian suite (default: bookworm)
  --mirror   Debian mirror (default: the first deb.debian.org-style URI in this host's
             apt sources, else http://deb.debian.org/debian)
  --tag      image tag (default: the suite)
EOF
}

engine=""
suite="bookworm"
mirror=""
tag=""
images=""
while [ $# -gt 0 ]; do
    case "$1" in
        --engine) engine="$2"; shift 2 ;;
        --suite) suite="$2"; shift 2 ;;
        --mirror) mirror="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        base|redis|prometheus) images="$images $1"; shift ;;
        *) echo "make-base.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
[ -n "$images" ] || images="base redis prometheus"
[ -n "$tag" ] || tag="$suite"
if [ -z "$engine" ]; then
    if command -v podman >/dev/null; then engine=podman; else engine=docker; fi
fi
command -v "$engine" >/dev/null || { echo "make-base.sh: $engine is not installed" >&2; exit 1; }
command -v mmdebstrap >/dev/null || {
    echo "make-base.sh: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
if [ -z "$mirror" ]; then
    mirror="$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
        /etc/apt/sources.list.d/ 2>/dev/null | head -n 1 | awk '{print $2}')" || true
    [ -n "$mirror" ] || mirror="http://deb.debian.org/debian"
fi

# What no container reads: documentation, locales, apt's package lists.
slim_hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb "$1"/var/log/*.log "$1"/var/log/apt/*'

build() {  # build NAME PACKAGES HOOK CHANGE...: the CHANGEs are Dockerfile lines for the import
    local name="$1" packages="$2" hook="$3"
    shift 3
    local image="localhost/pdserve-$name:$tag" change
    local -a changes=()
    for change in "$@"; do changes+=(--change "$change"); done
    echo ">> $image: mmdebstrap $suite ($packages) from $mirror" >&2
    local start tarball
    start="$(date +%s)"
    tarball="$(mktemp "${TMPDIR:-/tmp}/pdserve-$name.XXXXXX.tar")"
    mmdebstrap --quiet --variant=minbase --format=tar \
        --aptopt='APT::Install-Recommends "false"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --include="$packages" --customize-hook="$slim_hook" \
        ${hook:+--customize-hook="$hook"} \
        "$suite" "$tarball" "$mirror"
    "$engine" import "${changes[@]}" "$tarball" "$image" >/dev/null
    rm -f "$tarball"
    echo ">> $image: $(( $(date +%s) - start )) s" >&2
}

for name in $images; do
    case "$name" in
        base)
            build base python3,python3-venv,tini,ca-certificates "" \
                'ENV LANG=C.UTF-8' 'CMD ["python3"]'
            ;;
        redis)
            build redis redis-server "" \
                'EXPOSE 6379' 'CMD ["redis-server", "--protected-mode", "no"]'
            ;;
        prometheus)
            # As in prom/prometheus: the server is the entry point, data under /prometheus
            # owned by its user.
            build prometheus prometheus \
                'chroot "$1" install -d -o prometheus -g prometheus /prometheus' \
                'USER prometheus' 'WORKDIR /prometheus' 'EXPOSE 9090' \
                'ENTRYPOINT ["/usr/bin/prometheus"]' \
                'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
            ;;
    esac
done
