"""Produce a record whose header name is not UTF-8 (not a test module).

Kafka does not check header names, and a producer in another language (or a buggy
one) can send any bytes; confluent-kafka's own ``produce`` only takes ``str`` names.
So this goes straight through the librdkafka that confluent-kafka bundles, with
``rd_kafka_produceva`` (no variadic call through ctypes).
"""

from __future__ import annotations

import ctypes
import glob
import os

import confluent_kafka

_RD_KAFKA_PRODUCER = 0
_VTYPE_TOPIC, _VTYPE_VALUE, _VTYPE_KEY, _VTYPE_HEADERS = 1, 4, 5, 10


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _U(ctypes.Union):
    _fields_ = [
        ("cstr", ctypes.c_char_p),
        ("mem", _Mem),
        ("ptr", ctypes.c_void_p),
        ("_pad", ctypes.c_char * 64),
    ]


class _VU(ctypes.Structure):  # rd_kafka_vu_t
    _fields_ = [("vtype", ctypes.c_int), ("u", _U)]


def _librdkafka() -> ctypes.CDLL:
    here = os.path.dirname(confluent_kafka.__file__)
    [path] = glob.glob(os.path.join(here, "..", "confluent_kafka.libs", "librdkafka-*.so*"))
    lib = ctypes.CDLL(path)
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_headers_new.restype = ctypes.c_void_p
    lib.rd_kafka_headers_new.argtypes = [ctypes.c_size_t]
    lib.rd_kafka_header_add.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_ssize_t,
        ctypes.c_char_p,
        ctypes.c_ssize_t,
    ]
    lib.rd_kafka_produceva.restype = ctypes.c_void_p
    lib.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.POINTER(_VU), ctypes.c_size_t]
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    return lib


def produce_raw(
    bootstrap: str, topic: str, key: bytes, value: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """Produce one record with byte-string header names, and wait for its ack."""
    lib = _librdkafka()
    err = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    assert lib.rd_kafka_conf_set(conf, b"bootstrap.servers", bootstrap.encode(), err, 512) == 0
    rk = lib.rd_kafka_new(_RD_KAFKA_PRODUCER, conf, err, 512)
    assert rk, err.value
    try:
        hdrs = lib.rd_kafka_headers_new(len(headers))
        for name, val in headers:
            assert lib.rd_kafka_header_add(hdrs, name, len(name), val, len(val)) == 0
        kbuf = ctypes.create_string_buffer(key, len(key))
        vbuf = ctypes.create_string_buffer(value, len(value))
        vus = (_VU * 4)()
        vus[0].vtype, vus[0].u.cstr = _VTYPE_TOPIC, topic.encode()
        vus[1].vtype, vus[1].u.mem = _VTYPE_KEY, _Mem(ctypes.cast(kbuf, ctypes.c_void_p), len(key))
        vus[2].vtype = _VTYPE_VALUE
        vus[2].u.mem = _Mem(ctypes.cast(vbuf, ctypes.c_void_p), len(value))
        vus[3].vtype, vus[3].u.ptr = _VTYPE_HEADERS, hdrs  # the message owns them now
        assert not lib.rd_kafka_produceva(rk, vus, 4), "rd_kafka_produceva refused the record"
        assert lib.rd_kafka_flush(rk, 60_000) == 0, "the record was not acknowledged"
    finally:
        lib.rd_kafka_destroy(rk)
