#!/usr/bin/env bash
# Prepare a checkout for development, tests and the demo. Idempotent and quiet.
#
#   scripts/bootstrap.sh            # run it
#   source scripts/bootstrap.sh     # run it and keep .venv/bin on PATH
#
# What it does, and why:
#   * .venv via `python3 -m venv` (installs python3-venv with apt when that fails
#     and we are root), because CI starts from a fresh clone.
#   * `pip install -e '.[dev]'` only when pyproject.toml changed since the last
#     install (stamp file with its sha256), so repeated runs take a second.
#   * Java 17+ + Maven via apt when missing and we are root: the local Kafka broker
#     (services/kafka_local.py) resolves its jars with Maven and runs on the JVM.
#     The launcher's ensure_tools() does it (Java package: the first of
#     openjdk-17/openjdk-21/default-jre-headless the distribution has). Skipped when
#     KAFKA_BOOTSTRAP_SERVERS points at a broker elsewhere.

_sagaline_bootstrap() {
    local root py stamp want have
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    py="${PYTHON:-python3}"

    _sl_log() { printf 'bootstrap: %s\n' "$*" >&2; }
    _sl_is_root() { [ "$(id -u)" = "0" ]; }
    _sl_apt() {
        # apt-get quietly; show its output only when it fails. Waits for dpkg's lock
        # when another apt holds it (the machine's own updates) instead of failing.
        local out
        if ! out="$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@" 2>&1)"; then
            printf '%s\n' "$out" >&2
            return 1
        fi
    }
    _sl_apt_updated=0
    _sl_apt_install() {
        if ! _sl_is_root || ! command -v apt-get >/dev/null 2>&1; then
            return 1
        fi
        if [ "$_sl_apt_updated" = 0 ]; then
            _sl_apt update -qq || return 1
            _sl_apt_updated=1
        fi
        _sl_log "apt-get install $*"
        _sl_apt install -y -qq --no-install-recommends "$@"
    }

    if ! command -v "$py" >/dev/null 2>&1; then
        _sl_log "error: $py not found; install Python >= 3.11 (or set PYTHON=...)"
        return 1
    fi
    if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        _sl_log "error: $py is $("$py" -V 2>&1); Sagaline needs Python >= 3.11"
        return 1
    fi

    # 1. virtualenv
    if [ ! -x "$root/.venv/bin/python" ]; then
        _sl_log "creating .venv"
        if ! "$py" -m venv "$root/.venv" >/dev/null 2>&1; then
            rm -rf "$root/.venv"
            _sl_apt_install python3-venv || {
                _sl_log "error: '$py -m venv' failed and python3-venv cannot be installed (need root + apt-get)"
                return 1
            }
            "$py" -m venv "$root/.venv" || return 1
        fi
    fi

    # 2. the package and its dev extras, only when pyproject.toml changed
    stamp="$root/.venv/.sagaline-pyproject.sha256"
    want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
    have="$(cat "$stamp" 2>/dev/null || true)"
    if [ "$want" != "$have" ]; then
        _sl_log "pip install -e '.[dev]'"
        local log
        log="$(mktemp)"
        if ! (cd "$root" && .venv/bin/python -m pip install -q --disable-pip-version-check \
                -e '.[dev]') >"$log" 2>&1; then
            cat "$log" >&2
            rm -f "$log"
            _sl_log "error: pip install -e '.[dev]' failed"
            return 1
        fi
        rm -f "$log"
        printf '%s\n' "$want" >"$stamp"
    fi

    # 3. Java + Maven for the local Kafka broker: the launcher's own check and apt
    #    install (services/kafka_local.py ensure_tools: which Java package the
    #    distribution has, e.g. openjdk-17 on Debian 12, openjdk-21 on Debian 13).
    if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
        if ! command -v java >/dev/null 2>&1 || ! command -v mvn >/dev/null 2>&1; then
            _sl_log "installing Java and Maven for the local Kafka broker"
        fi
        (cd "$root" && .venv/bin/python -c '
import sys
from services import kafka_local
try:
    kafka_local.ensure_tools()
except kafka_local.ToolMissingError as exc:
    sys.exit(f"bootstrap: error: {exc}")
') || return 1
    fi

    export VIRTUAL_ENV="$root/.venv"
    case ":$PATH:" in
        *":$root/.venv/bin:"*) ;;
        *) export PATH="$root/.venv/bin:$PATH" ;;
    esac
    return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    _sagaline_bootstrap
else
    _sagaline_bootstrap
fi
