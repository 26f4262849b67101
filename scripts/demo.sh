#!/usr/bin/env bash
# Run the Sagaline demo against a real local Kafka broker.
#
#   scripts/demo.sh [demo args...]
#
# Bootstraps the checkout, makes sure a broker runs (`sagaline kafka up`, reused
# if already running), then runs `sagaline demo "$@"`: its exit status is ours (a
# `sagaline` that cannot start fails the script; nothing else runs in its place).
# The broker is left running; stop it with `sagaline kafka down`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# shellcheck source=scripts/bootstrap.sh
source scripts/bootstrap.sh

if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
    KAFKA_BOOTSTRAP_SERVERS="$(python -m services.kafka_cli up | tail -n1)"
    export KAFKA_BOOTSTRAP_SERVERS
fi
echo "demo.sh: Kafka at $KAFKA_BOOTSTRAP_SERVERS" >&2

exec sagaline demo "$@"
