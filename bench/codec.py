"""Codec cost per record type, against a JSON baseline, in one run.

Run: ``python -m bench.codec`` (or ``python bench/codec.py``). Prints, per record
type, the Avro single-object encode and decode cost (decode includes pydantic
validation, as in production), records per second for a full round trip, the
encoded size, and the same numbers for a JSON baseline (orjson over
``model_dump(mode="json")``, ``model_validate`` over ``orjson.loads``) with the ratio.

A benchmark, not a test: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import platform
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too

from schemas.codec import decode, encode
from schemas.examples import example_records
from schemas.models import Record


def _per_call_us(fn: Callable[[], object], min_time_s: float) -> float:
    """Best-of-5 microseconds per call, each repeat running at least ``min_time_s``."""
    timer = timeit.Timer(fn)
    estimate = timer.timeit(number=200) / 200
    number = max(100, int(min_time_s / max(estimate, 1e-9)))
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def _json_encode(record: Record) -> bytes:
    return orjson.dumps(record.model_dump(mode="json"))


def _json_decode(record_type: type[Record], data: bytes) -> Record:
    return record_type.model_validate(orjson.loads(data))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-time", type=float, default=0.02, help="seconds per repeat")
    args = parser.parse_args(argv)

    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{platform.system()}; best of 5 repeats"
    )
    header = (
        f"{'record type':<22} {'enc µs':>7} {'dec µs':>7} {'rt rec/s':>9} {'bytes':>6}"
        f" | {'json enc':>8} {'json dec':>8} {'json rec/s':>10} {'bytes':>6} | {'speed':>6}"
    )
    print(header)
    print("-" * len(header))
    totals = [0.0, 0.0, 0.0, 0.0]
    records = example_records()
    for record in records:
        record_type = type(record)
        data = encode(record)
        js = _json_encode(record)
        assert decode(data) == record and _json_decode(record_type, js) == record
        enc = _per_call_us(lambda r=record: encode(r), args.min_time)  # type: ignore[misc]
        dec = _per_call_us(lambda d=data: decode(d), args.min_time)  # type: ignore[misc]
        jenc = _per_call_us(lambda r=record: _json_encode(r), args.min_time)  # type: ignore[misc]
        jdec = _per_call_us(
            lambda t=record_type, j=js: _json_decode(t, j),  # type: ignore[misc]
            args.min_time,
        )
        totals = [totals[0] + enc, totals[1] + dec, totals[2] + jenc, totals[3] + jdec]
        print(
            f"{record_type.TYPE:<22} {enc:>7.1f} {dec:>7.1f} {1e6 / (enc + dec):>9,.0f} "
            f"{len(data):>6} | {jenc:>8.1f} {jdec:>8.1f} {1e6 / (jenc + jdec):>10,.0f} "
            f"{len(js):>6} | {(jenc + jdec) / (enc + dec):>5.2f}x"
        )
    n = len(records)
    enc, dec, jenc, jdec = (t / n for t in totals)
    print("-" * len(header))
    print(
        f"{'mean':<22} {enc:>7.1f} {dec:>7.1f} {1e6 / (enc + dec):>9,.0f} {'':>6} | "
        f"{jenc:>8.1f} {jdec:>8.1f} {1e6 / (jenc + jdec):>10,.0f} {'':>6} | "
        f"{(jenc + jdec) / (enc + dec):>5.2f}x"
    )
    print(
        "speed = JSON round-trip time / Avro round-trip time (above 1: Avro is faster). "
        "Avro decode includes schema lookup by fingerprint and pydantic validation."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
