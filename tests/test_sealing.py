"""Secret arguments are sealed for the tool and never written in clear."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from schemas.keys import args_fingerprint, canonical_json
from schemas.redaction import is_redacted
from schemas.sealing import Sealer, SealError, is_sealed

CARD = "4111111111111111"
ARGS = {"amount": 500, "card": {"number": CARD, "cvv": "123"}}
PATHS = ("card.number", "card.cvv")


def test_sealed_arguments_open_to_the_exact_clear_values() -> None:
    sealer = Sealer(b"shared secret")
    sealed = sealer.seal(ARGS, PATHS, "saga-1")
    assert is_sealed(sealed["card"]["number"]) and sealed["amount"] == 500
    assert CARD.encode() not in canonical_json(sealed)
    assert sealer.open(sealed, PATHS, "saga-1") == ARGS


def test_a_sealed_value_does_not_open_in_another_saga() -> None:
    sealer = Sealer(b"shared secret")
    sealed = sealer.seal(ARGS, PATHS, "saga-1")
    with pytest.raises(SealError, match="saga-2"):
        sealer.open(sealed, PATHS, "saga-2")


def test_a_sealed_value_does_not_open_with_another_key() -> None:
    sealed = Sealer(b"shared secret").seal(ARGS, PATHS, "saga-1")
    with pytest.raises(SealError, match="does not open with this key"):
        Sealer(b"other").open(sealed, PATHS, "saga-1")


def test_without_a_key_secrets_are_redacted_not_sent_in_clear() -> None:
    sealed = Sealer(None).seal(ARGS, PATHS, "saga-1")
    assert is_redacted(sealed["card"]["number"])
    assert CARD.encode() not in canonical_json(sealed)


def test_a_process_without_the_key_says_what_to_configure() -> None:
    sealed = Sealer(b"k").seal(ARGS, PATHS, "saga-1")
    with pytest.raises(SealError, match="SAGALINE_SECRET_KEY"):
        Sealer(None).open(sealed, PATHS, "saga-1")


@pytest.mark.parametrize(
    "box",
    [
        "not base64!",  # an invalid character
        "abc",  # bad padding
        "AAAA",  # 3 bytes: shorter than a nonce
        "A" * 36,  # 27 bytes: a nonce and no whole tag
        None,  # not text at all
    ],
)
def test_a_malformed_sealed_value_is_a_seal_error_naming_the_argument(box: object) -> None:
    sealer = Sealer(b"shared secret")
    sealed = sealer.seal(ARGS, PATHS, "saga-1")
    sealed["card"]["number"]["$sealed"] = box
    with pytest.raises(SealError, match=r"argument 'card\.number' of saga saga-1 is malformed"):
        sealer.open(sealed, PATHS, "saga-1")


def test_a_secret_inside_a_sealed_secret_opens_too() -> None:
    # tuple[Inner, Secret] lists "t.*.pin" and then "t.*": sealing seals the pin, then
    # the whole item around it; opening must undo that in reverse, or the tool gets
    # the pin still sealed.
    paths = ("t.*.pin", "t.*")
    args = {"t": [{"pin": 1234}, "x"]}
    sealer = Sealer(b"shared secret")
    sealed = sealer.seal(args, paths, "saga-1")
    assert b"1234" not in canonical_json(sealed)
    assert sealer.open(sealed, paths, "saga-1") == args


@pytest.mark.parametrize("key", [b"shared secret", None], ids=["sealed", "redacted"])
def test_pydantic_secret_values_are_sealed_or_redacted_like_plain_ones(key: bytes | None) -> None:
    # An agent passing a model's model_dump() hands over SecretStr objects, nested too.
    args = {"amount": 500, "card": {"number": SecretStr(CARD), "cvv": SecretStr("123")}}
    whole = {"amount": 500, "card": {"number": SecretStr(CARD), "cvv": "123"}}
    sealer = Sealer(key)
    sealed = sealer.seal(args, PATHS, "saga-1")
    sealed_whole = sealer.seal(whole, ("card",), "saga-1")
    for out in (sealed, sealed_whole):
        assert CARD.encode() not in canonical_json(out)
    if key is not None:
        assert sealer.open(sealed, PATHS, "saga-1") == ARGS
        assert sealer.open(sealed_whole, ("card",), "saga-1") == ARGS
    else:
        assert sealed == Sealer(None).seal(ARGS, PATHS, "saga-1")
        assert sealed_whole == Sealer(None).seal(ARGS, ("card",), "saga-1")


@pytest.mark.parametrize("key", [None, b"shared secret"], ids=["redacted", "sealed"])
def test_a_short_secret_cannot_be_recovered_from_the_ledger_by_guessing(key: bytes | None) -> None:
    """A PIN has 10,000 values: an unsalted digest of it on the ledger (marker or
    sealed "fp") gives it back to anyone who hashes them all."""
    import hashlib

    pin = "4821"
    written = canonical_json(Sealer(key).seal({"pin": pin}, ("pin",), "saga-1")).decode()
    guesses = [f"{i:04d}" for i in range(10_000)]
    recovered = [g for g in guesses if hashlib.sha256(g.encode()).hexdigest()[:12] in written]
    recovered += [
        g for g in guesses if Sealer(None).seal({"pin": g}, ("pin",), "s")["pin"] in written
    ]
    assert len(set(recovered)) != 1, f"the ledger gives the PIN away: {written}"


@pytest.mark.parametrize(
    ("args", "paths"),
    [
        (ARGS, PATHS),
        ({"t": [{"pin": 1234}, "x"]}, ("t.*.pin", "t.*")),  # a secret inside a secret
    ],
    ids=["flat", "nested"],
)
def test_the_same_arguments_sealed_twice_have_the_same_fingerprint(
    args: dict[str, object], paths: tuple[str, ...]
) -> None:
    """Sealing draws a random nonce, so the same call sealed again (repeated under
    its step id after attach()) has other bytes; its arguments fingerprint is the
    same, or the coordinator rejects the repeat as a duplicate step. Other clear
    values, or another key, give another fingerprint."""
    sealer = Sealer(b"shared secret")
    once = canonical_json(sealer.seal(args, paths, "saga-1"))
    again = canonical_json(sealer.seal(args, paths, "saga-1"))
    assert once != again
    assert args_fingerprint(once) == args_fingerprint(again)
    other = canonical_json(sealer.seal({**args, "x": 1}, paths, "saga-1"))
    assert args_fingerprint(other) != args_fingerprint(once)
    other_key = canonical_json(Sealer(b"other secret").seal(args, paths, "saga-1"))
    assert args_fingerprint(other_key) != args_fingerprint(once)


def test_a_fingerprint_of_sealed_arguments_covers_the_keyed_marker_not_the_value() -> None:
    pin = "4821"
    sealed = canonical_json(Sealer(b"shared secret").seal({"pin": pin}, ("pin",), "saga-1"))
    fp = args_fingerprint(sealed)
    guesses = [args_fingerprint(canonical_json({"pin": f"{i:04d}"})) for i in range(10_000)]
    assert fp not in guesses
    different_pin = Sealer(b"shared secret").seal({"pin": "4822"}, ("pin",), "saga-1")
    assert args_fingerprint(canonical_json(different_pin)) != fp
