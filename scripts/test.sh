#!/usr/bin/env bash
# Lint, type-check and test Sagaline against a real Kafka broker.
#
#   scripts/test.sh                         # everything
#   scripts/test.sh tests/test_kafka_local.py -x   # args go to pytest (one pytest, as given)
#
# Steps: scripts/bootstrap.sh (venv, deps, Java/Maven); `sagaline kafka up` (run as
# `python -m services.kafka_cli up`, which needs no other area's CLI code) unless
# KAFKA_BOOTSTRAP_SERVERS is already set (first run resolves the Kafka jars with
# Maven and starts the broker; later runs reuse it); then ruff, mypy and the
# import-layer contracts (lint-imports) beside pytest. Without arguments pytest runs
# the suite in parallel (pytest-xdist, SAGALINE_TEST_WORKERS workers, default 4) and
# then, serially, the secret scan (`-m secretscan`) that must see what every other
# test wrote; with arguments, one `pytest ARGS` (add `-n 4` yourself). All of them
# run even if one fails, so one run shows every problem; the exit code is non-zero
# if any failed, or if a pytest collected no tests (exit 5). With CI=true the broker
# starts on an empty data dir (`up --fresh`: a long-lived broker keeps every earlier
# run's topics, and thousands of them slow its start-up past the tests' topic setup)
# and is stopped at the end.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# shellcheck source=scripts/bootstrap.sh
source scripts/bootstrap.sh || { echo "test.sh: bootstrap failed" >&2; exit 1; }

started_broker=0
stop_broker() {
    if [ "$started_broker" = 1 ] && { [ "${CI:-}" = "true" ] || [ "${SAGALINE_STOP_BROKER:-}" = "1" ]; }; then
        python -m services.kafka_cli down >&2 || true
    fi
}
trap stop_broker EXIT

if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
    start=$SECONDS
    up_args=()
    [ "${CI:-}" = "true" ] && up_args+=(--fresh)
    if ! up_out="$(python -m services.kafka_cli up "${up_args[@]}")"; then
        echo "test.sh: could not start the local Kafka broker (see above)" >&2
        exit 1
    fi
    started_broker=1
    KAFKA_BOOTSTRAP_SERVERS="$(printf '%s\n' "$up_out" | tail -n1)"
    export KAFKA_BOOTSTRAP_SERVERS
    echo "test.sh: Kafka at $KAFKA_BOOTSTRAP_SERVERS ($((SECONDS - start))s)" >&2
else
    echo "test.sh: using KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS" >&2
fi

# The compose file is validated by Debian's docker-compose (1.29: `config -q` checks
# it against the Compose schema without a Docker engine).
if ! command -v docker-compose >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test.sh: apt-get install docker-compose (compose file validation)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            docker-compose >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
                 apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; } \
            || echo "test.sh: could not install docker-compose; the compose test will fail" >&2
    fi
fi

failed=()

# The static checks need the CPU while pytest mostly waits on the broker and its
# subprocesses, so they run beside it; their output is printed after pytest's.
static_dir="$(mktemp -d)"
static_checks() {
    echo "== ruff check ."
    ruff check . || echo ruff >>"$static_dir/failed"
    echo "== mypy (strict)"
    mypy || echo mypy >>"$static_dir/failed"
    # Layers point down only, confluent_kafka only in sagaline/kafka, the local broker
    # launcher on no production path: contracts in pyproject.toml [tool.importlinter].
    echo "== lint-imports (layer contracts)"
    lint-imports --no-cache || echo lint-imports >>"$static_dir/failed"
}
static_checks >"$static_dir/log" 2>&1 &
static_pid=$!

run_pytest() {
    echo "== pytest $*" >&2
    local start=$SECONDS rc
    pytest "$@"
    rc=$?
    echo "test.sh: pytest $* took $((SECONDS - start))s" >&2
    if [ "$rc" = 5 ]; then
        echo "test.sh: pytest collected no tests; that counts as a failure" >&2
        failed+=("pytest(no tests)")
    elif [ "$rc" != 0 ]; then
        failed+=("pytest(exit $rc)")
    fi
}

if [ "$#" -gt 0 ]; then
    run_pytest "$@"
else
    # The suite on SAGALINE_TEST_WORKERS pytest-xdist workers (tests isolate themselves
    # by topic prefix and tmp_path; a module whose fixture starts something expensive
    # stays on one worker: xdist_group + --dist loadgroup). Then the secret scan, which
    # reads every topic the suite left on the broker, so it runs alone and last.
    # Each session deletes its own topics and consumer groups when it ends
    # (tests/conftest.py); here the workers only record their topic prefixes, and the
    # topics and groups go after the scan.
    prefix_file="$(mktemp)"
    SAGALINE_TEST_TOPIC_PREFIX_FILE="$prefix_file" \
        run_pytest -n "${SAGALINE_TEST_WORKERS:-4}" --dist loadgroup -m "not secretscan"
    run_pytest -m secretscan
    if [ "${SAGALINE_KEEP_TEST_TOPICS:-}" != "1" ]; then
        python -m tests.topic_cleanup "$prefix_file" "$KAFKA_BOOTSTRAP_SERVERS" \
            || failed+=("test topic cleanup")
    fi
    rm -f "$prefix_file"
fi

wait "$static_pid"
cat "$static_dir/log" >&2
if [ -s "$static_dir/failed" ]; then
    while read -r name; do failed+=("$name"); done <"$static_dir/failed"
fi
rm -rf "$static_dir"

if [ "${#failed[@]}" -gt 0 ]; then
    echo "test.sh: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test.sh: all checks passed" >&2
