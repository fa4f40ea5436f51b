#!/usr/bin/env bash
# Starts a private dockerd (no bridge, no iptables, its own data root and socket) and builds the env worker
# image without any registry: a Debian base from debootstrap + `docker import`, then envs/Dockerfile on it.
# Idempotent: an already running daemon and already built images are reused.
#   env: JAXAGENT_DOCKER_HOST (default unix:///run/jaxagent-docker/docker.sock)
#        JAXAGENT_DOCKER_ROOT (default /var/lib/jaxagent-docker), DEBIAN_MIRROR, DEBIAN_SUITE
set -euo pipefail
cd "$(dirname "$0")/../.."
SOCK_DIR=/run/jaxagent-docker
HOST="${JAXAGENT_DOCKER_HOST:-unix://$SOCK_DIR/docker.sock}"
ROOT="${JAXAGENT_DOCKER_ROOT:-/var/lib/jaxagent-docker}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE="${DEBIAN_SUITE:-bookworm}"
export DOCKER_HOST="$HOST"
for tool in docker dockerd debootstrap; do
  command -v "$tool" >/dev/null || { echo "setup.sh: $tool is not on the PATH (Debian: .ci/provision installs" \
    "docker.io and debootstrap, each only if missing)"; exit 1; }
done

if ! docker info >/dev/null 2>&1; then
  mkdir -p "$SOCK_DIR" "$ROOT/data" "$ROOT/exec"
  # --bridge=none: containers get no network device beyond loopback; the default bridge's private range
  # must never carry traffic here.
  nohup dockerd --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
    --data-root "$ROOT/data" --exec-root "$ROOT/exec" --pidfile "$SOCK_DIR/dockerd.pid" \
    -H "$HOST" >"$ROOT/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; log:"; tail -20 "$ROOT/dockerd.log"; exit 1; }
fi

if ! docker image inspect jaxagent-base:"$SUITE"-3 >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-msgpack,python3-jsonschema,coreutils,bubblewrap "$SUITE" "$tmp/root" "$MIRROR" \
    >"$ROOT/debootstrap.log" 2>&1 || { tail -20 "$ROOT/debootstrap.log"; exit 1; }
  rm -rf "$tmp/root/var/cache/apt/archives"/*.deb "$tmp/root/var/lib/apt/lists"/*
  tar -C "$tmp/root" -c . | docker import - jaxagent-base:"$SUITE"-3 >/dev/null
  rm -rf "$tmp"
fi
docker build -q --network none --build-arg BASE=jaxagent-base:"$SUITE"-3 -t jaxagent-envs:latest envs >/dev/null
echo "docker ready: $HOST, image jaxagent-envs:latest ($(docker image inspect -f '{{.Id}}' jaxagent-envs:latest | cut -c1-19))"
