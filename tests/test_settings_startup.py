"""Start-up of the deployables on a configuration that cannot work: one clear line
and exit code 2, never a traceback, and never a quiet fall-back to a weaker mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.settings import ENV_VARS, Settings, SettingsError
from services.cli import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    "env",
    [
        {"SAGALINE_SIGNING_KEY": "/secrets/payments.pem"},
        {"SAGALINE_SIGNING_KEY_ID": "payments.1"},
        {"SAGALINE_SIGNING_KEY": "/secrets/payments.pem", "SAGALINE_HMAC_KEY": "k"},
    ],
)
def test_a_signing_key_without_a_trust_file_is_refused_not_ignored(env: dict[str, str]) -> None:
    """The process was meant to sign as an identity; without the trust file it signed
    with the shared HMAC key, or not at all, and said nothing."""
    with pytest.raises(SettingsError, match="SAGALINE_TRUST_FILE"):
        Settings.from_env(env)


@pytest.mark.kafka
def test_a_command_with_a_signing_key_but_no_trust_file_exits_2_saying_so(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_SIGNING_KEY", str(tmp_path / "payments.pem"))
    assert main(["incidents", "list"]) == 2
    err = capsys.readouterr().err
    assert "SAGALINE_SIGNING_KEY" in err and "SAGALINE_TRUST_FILE" in err, err
