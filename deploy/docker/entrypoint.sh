#!/bin/sh
# Container entry point: `pdserve "$@"`, after one substitution.
#
# A worker registers the URL it is bound to, so in a container it must bind an address the
# other containers can reach, and that address is only known at start: PDSERVE_HOST=container-ip
# stands for this container's own IP (the first address `hostname -i` reports). Kubernetes
# does not need it: the pod IP comes from the downward API.
set -eu
if [ "${PDSERVE_HOST:-}" = "container-ip" ]; then
    PDSERVE_HOST="$(hostname -i | cut -d' ' -f1)"
    export PDSERVE_HOST
fi
exec pdserve "$@"
