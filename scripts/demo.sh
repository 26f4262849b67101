#!/usr/bin/env bash
# Run the Sagaline demo against a real local Kafka broker.
#
#   scripts/demo.sh [demo args...]
#
# Bootstraps the checkout, makes sure a broker runs (`sagaline kafka up`, reused
# if already running), then runs `sagaline demo "$@"` when that command exists,
# else `python -m services.smoke` when that module exists, else just says the
# broker is up. The broker is left running; stop it with `sagaline kafka down`.
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

if sagaline demo --help >/dev/null 2>&1; then
    exec sagaline demo "$@"
elif python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("services.smoke") is None)' 2>/dev/null; then
    exec python -m services.smoke "$@"
else
    echo "demo.sh: the Kafka broker is up at $KAFKA_BOOTSTRAP_SERVERS; no demo or smoke module exists yet."
fi
