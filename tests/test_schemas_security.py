"""Signing and redaction: a record is provably ours, and a secret never reaches a
topic in clear (issue 2; R16 for the typed errors that route to the DLQ)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
import pytest
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr
from pydantic import Secret as PydanticSecret
from pydantic.alias_generators import to_camel
from typing_extensions import TypedDict

from schemas.codec import encode
from schemas.errors import BadSignature, MissingSignature
from schemas.examples import example_records
from schemas.keys import args_fingerprint
from schemas.models import StepScheduled
from schemas.redaction import (
    SECRET,
    Secret,
    is_redacted,
    redact,
    redacted_json,
    redaction_marker,
    scrub,
    secret_paths,
)
from schemas.settings import Settings
from schemas.signing import KID_HEADER, SIG_HEADER, Signer
from schemas.wire import from_message, to_message

KEY = b"a-long-random-test-secret"


def _message() -> tuple[bytes, bytes]:
    record = example_records(saga_id="saga-1")[0]
    return record.saga_id.encode(), encode(record)


# ------------------------------------------------------------------- signing


def test_signed_record_verifies() -> None:
    signer = Signer(KEY)
    key, value = _message()
    signer.verify(key, value, signer.headers(key, value))


def test_signature_travels_in_sig_and_kid_headers() -> None:
    key, value = _message()
    headers = dict(Signer(KEY, key_id="k7").headers(key, value))
    assert headers[KID_HEADER] == b"k7"
    signature = headers[SIG_HEADER]
    assert isinstance(signature, bytes)
    assert len(bytes.fromhex(signature.decode())) == 32


def test_altered_value_is_a_bad_signature() -> None:
    signer = Signer(KEY)
    key, value = _message()
    headers = signer.headers(key, value)
    tampered = value[:-1] + bytes([value[-1] ^ 1])
    with pytest.raises(BadSignature, match="mismatch") as err:
        signer.verify(key, tampered, headers)
    assert err.value.reason == "bad-signature"


def test_value_moved_to_another_saga_is_a_bad_signature() -> None:
    signer = Signer(KEY)
    key, value = _message()
    headers = signer.headers(key, value)
    with pytest.raises(BadSignature, match="saga-2"):
        signer.verify(b"saga-2", value, headers)


def test_record_signed_with_another_secret_is_a_bad_signature() -> None:
    key, value = _message()
    headers = Signer(b"another-secret").headers(key, value)
    with pytest.raises(BadSignature):
        Signer(KEY).verify(key, value, headers)


def test_record_signed_under_another_key_id_is_a_bad_signature_naming_both() -> None:
    key, value = _message()
    headers = Signer(KEY, key_id="old").headers(key, value)
    with pytest.raises(BadSignature, match=r"'old'.*'k1'"):
        Signer(KEY, key_id="k1").verify(key, value, headers)


def test_unsigned_record_is_missing_a_signature_when_a_key_is_configured() -> None:
    key, value = _message()
    with pytest.raises(MissingSignature, match=SIG_HEADER) as err:
        Signer(KEY).verify(key, value, None)
    assert err.value.reason == "missing-signature"


def test_without_a_key_nothing_is_signed_and_everything_verifies() -> None:
    signer = Signer(None)
    key, value = _message()
    assert signer.headers(key, value) == []
    signer.verify(key, value, [])
    assert not signer.enabled


def test_non_hex_signature_is_a_bad_signature() -> None:
    key, value = _message()
    with pytest.raises(BadSignature, match="not hex"):
        Signer(KEY).verify(key, value, [(SIG_HEADER, b"zz")])


def test_key_never_appears_in_reprs() -> None:
    settings = Settings(hmac_key=KEY)
    shown = repr(Signer(KEY)) + repr(settings) + str(settings) + repr(settings.signer())
    assert KEY.decode() not in shown
    assert "hmac_key=" not in repr(settings)


def test_from_message_verifies_before_decoding() -> None:
    record = example_records(saga_id="saga-1")[3]
    signer = Signer(KEY)
    key, value, headers = to_message(record, signer)
    assert from_message(key, value, headers, signer) == record
    with pytest.raises(MissingSignature):
        from_message(key, value, [], signer)


# ----------------------------------------------------------------- redaction


class Card(BaseModel):
    number: Secret
    cvv: Annotated[int, SECRET]
    holder: str


class ChargeArgs(BaseModel):
    amount_cents: int
    card: Card
    backup_cards: list[Card] = []
    api_token: SecretStr | None = None
    labels: dict[str, str] = {}


def test_secret_paths_lists_marked_fields_of_nested_models_and_lists() -> None:
    assert secret_paths(ChargeArgs) == (
        "card.number",
        "card.cvv",
        "backup_cards.*.number",
        "backup_cards.*.cvv",
        "api_token",
    )


def test_redact_replaces_secrets_with_a_marker_and_keeps_the_rest() -> None:
    args: dict[str, Any] = {
        "amount_cents": 1999,
        "card": {"number": "4111111111111111", "cvv": 123, "holder": "Ada"},
        "backup_cards": [{"number": "5500000000000004", "cvv": 999, "holder": "Ada"}],
        "api_token": "tok_live_abc",
    }
    redacted = redact(args, secret_paths(ChargeArgs))
    assert redacted["amount_cents"] == 1999
    assert redacted["card"]["holder"] == "Ada"
    assert redacted["card"]["number"] == redaction_marker("4111111111111111") == "[redacted]"
    keyed = redact(args, secret_paths(ChargeArgs), KEY)
    assert keyed["card"]["number"] == redaction_marker("4111111111111111", KEY)
    assert keyed["card"]["number"].startswith("[redacted hmac:")
    assert len(keyed["card"]["number"]) == len("[redacted hmac:]") + 12
    assert is_redacted(keyed["card"]["number"])
    assert is_redacted("[redacted sha256:a388f562e286]"), "markers already on a ledger"
    assert is_redacted(redacted["backup_cards"][0]["cvv"])
    assert is_redacted(redacted["api_token"])
    assert args["card"]["number"] == "4111111111111111", "the input is not mutated"


def test_redaction_is_idempotent_and_skips_absent_paths() -> None:
    args = {"amount_cents": 5, "card": {"number": "4111", "cvv": 1, "holder": "x"}}
    once = redact(args, secret_paths(ChargeArgs))
    assert redact(once, secret_paths(ChargeArgs)) == once
    assert "api_token" not in once


def test_equal_secrets_redact_equally_so_the_key_holder_can_correlate() -> None:
    assert redaction_marker("4111", KEY) == redaction_marker("4111", KEY)
    assert redaction_marker("4111", KEY) != redaction_marker("4112", KEY)
    assert redaction_marker("4111", KEY) != redaction_marker("4111", b"another deployment")
    # Without a key nothing of the value is shown: every secret is the same marker.
    assert redaction_marker("4111") == redaction_marker("4112") == "[redacted]"


def test_secret_never_appears_in_the_encoded_step_scheduled() -> None:
    card_number = "4111111111111111"
    token = "tok_live_d34db33f"
    args = {
        "amount_cents": 1999,
        "card": {"number": card_number, "cvv": 737, "holder": "Ada"},
        "api_token": token,
    }
    args_json = redacted_json(args, secret_paths(ChargeArgs))
    template = next(r for r in example_records() if isinstance(r, StepScheduled))
    record = template.model_copy(
        update={"args": args_json, "args_fingerprint": args_fingerprint(args_json)}
    )

    wire_bytes = encode(record)

    assert card_number.encode() not in wire_bytes
    assert token.encode() not in wire_bytes
    assert b"737" not in wire_bytes
    assert b"Ada" in wire_bytes, "non-secret arguments are kept"
    assert orjson.loads(record.args)["card"]["number"] == redaction_marker(card_number)


class CamelCard(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel)
    card_number: Secret
    holder: str


class Pin(TypedDict):
    pin: Secret


@dataclass
class Login:
    password: Secret


class AliasedArgs(BaseModel):
    card: CamelCard
    pin: Pin
    login: Login
    api_key: Secret = Field(validation_alias=AliasChoices("apiKey", "api_key"))


def test_secrets_are_redacted_under_the_names_the_arguments_use() -> None:
    # Tool arguments arrive as the model validates them: aliased fields under their
    # alias (a model's JSON schema shows the alias), TypedDict and dataclass fields
    # by name. Each secret there must be redacted, not only model fields by name.
    args = {
        "card": {"cardNumber": "4111111111111111", "holder": "Ada"},
        "pin": {"pin": "8642"},
        "login": {"password": "hunter2"},
        "apiKey": "sk_live_f00d",
    }
    AliasedArgs.model_validate(args)  # what the tool will be called with
    body = redacted_json(args, secret_paths(AliasedArgs))
    for secret in (b"4111111111111111", b"8642", b"hunter2", b"sk_live_f00d"):
        assert secret not in body
    assert b"Ada" in body


class AbstractCollections(BaseModel):
    tokens: Sequence[Secret]
    by_bank: Mapping[str, Secret]
    cards: Sequence[Card] = ()
    pins: AbstractSet[Secret] = frozenset()


def test_secrets_in_abstract_collection_types_are_redacted() -> None:
    # typing.get_origin(Sequence[X]) is collections.abc.Sequence, not typing.Sequence:
    # fields typed with the abstract collections must be walked like list and dict.
    args = {
        "tokens": ["tok_live_1a2b"],
        "by_bank": {"acme": "sk_live_3c4d"},
        "cards": [{"number": "4111111111111111", "cvv": 737, "holder": "Ada"}],
        "pins": ["8642"],
    }
    AbstractCollections.model_validate(args)
    body = redacted_json(args, secret_paths(AbstractCollections))
    for secret in (b"tok_live_1a2b", b"sk_live_3c4d", b"4111111111111111", b"737", b"8642"):
        assert secret not in body
    assert b"Ada" in body


def test_scrub_replaces_every_clear_secret_in_a_message_with_its_marker() -> None:
    args = {
        "amount_cents": 1999,
        "card": {"number": "4111111111111111", "cvv": 737, "holder": "Ada"},
        "backup_cards": [{"number": "41111111", "cvv": 999, "holder": "Ada"}],
    }
    message = "card 4111111111111111 (cvv 737) and 41111111 declined for Ada, 1500 cents"
    scrubbed = scrub(message, args, secret_paths(ChargeArgs), KEY)
    for secret in ("41111111", "737", "999"):
        assert secret not in scrubbed
    assert redaction_marker("4111111111111111", KEY) in scrubbed  # the longer one, whole
    assert redaction_marker(737, KEY) in scrubbed and "Ada, 1500 cents" in scrubbed
    unkeyed = scrub(message, args, secret_paths(ChargeArgs))
    assert unkeyed == "card [redacted] (cvv [redacted]) and [redacted] declined for Ada, 1500 cents"


@pytest.mark.parametrize(
    ("secret", "quote"),
    [
        ("pässwörd-1", lambda s: orjson.dumps({"password": s}).decode()),  # JSON, raw
        ("pässwörd-1", lambda s: json.dumps({"password": s})),  # JSON, \u escapes
        ('s3"cr\\et', lambda s: json.dumps({"password": s})),  # JSON, \" and \\
        ("it's\\mine", lambda s: str(KeyError(s))),  # a repr: \' and \\
        ("line1\nline2", lambda s: f"bad token {s!r}"),  # a repr: \n
        ("pässwörd-1", lambda s: ascii(s)),  # ascii(): \xe4
    ],
)
def test_scrub_replaces_secrets_quoted_as_json_or_repr(
    secret: str, quote: Callable[[str], str]
) -> None:
    # Tools and SDKs quote their input in errors as JSON bodies or Python reprs; the
    # secret must not survive in its escaped spelling either.
    message = f"request failed: {quote(secret)}"
    scrubbed = scrub(message, {"password": secret}, ("password",), KEY)
    assert redaction_marker(secret, KEY) in scrubbed, scrubbed
    for part in ("sswö", "ss\\u00e4", "ss\\xe4", "cr\\\\", "s3\\", "line2", "mine"):
        if part in message:
            assert part not in scrubbed, scrubbed


class ApiToken(SecretStr):
    """A project's own secret type, derived from pydantic's."""


class PydanticSecrets(BaseModel):
    pin: PydanticSecret[int]
    account: PydanticSecret[str] | None = None
    token: ApiToken
    note: str


def test_pydantic_generic_secrets_and_secret_subclasses_are_redacted() -> None:
    # pydantic.Secret[T] (and subclasses of SecretStr) are pydantic's own secret
    # types: a tool declaring them must not have the value reach the ledger.
    assert set(secret_paths(PydanticSecrets)) == {"pin", "account", "token"}
    args = {"pin": 8642, "account": "DE44500105175407324931", "token": "tok_9z8y", "note": "hi"}
    PydanticSecrets.model_validate(args)
    body = redacted_json(args, secret_paths(PydanticSecrets))
    for secret in (b"8642", b"DE44500105175407324931", b"tok_9z8y"):
        assert secret not in body
    assert b"hi" in body
