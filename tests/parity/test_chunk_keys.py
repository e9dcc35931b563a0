"""Chunk keys: kdn against an independent implementation of docs/kvbus.md.

The keys are recomputed here from the spec alone (struct for the byte layout,
the xxhash package for XXH3-128) and compared with what the C++ code prints
through the test-only program kdn_keys, over seeded random token lists,
several namespaces (non-ASCII included), several chunk sizes and token ids up
to 2^31 - 1. A client in another language that passes this is compatible.
"""
import os
import random
import struct
import subprocess
from pathlib import Path

import pytest
import xxhash

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))
KDN_KEYS = BIN / "kdn_keys"

KEY_VERSION = 1  # docs/kvbus.md: the XXH3 seed
FINGERPRINTS = [
    "0123456789abcdeffedcba9876543210",
    "00000000000000000000000000000000",
    "ffffffffffffffffffffffffffffffff",
    "8000000000000001000000000000007f",
]
NAMESPACES = ["", "tenant-a", "Grüße", "東京", "🙂 emoji", "a,b c", "x" * 300]
MAX_ID = 2**31 - 1


# ---- the spec, independently -------------------------------------------------

def _h128(data: bytes) -> bytes:
    # The 16 canonical (big-endian: high 64 bits first) bytes of XXH3-128.
    return xxhash.xxh3_128_digest(data, seed=KEY_VERSION)


def _namespace(ns: str) -> bytes:
    b = ns.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def _tokens(ids) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def prefix_keys(fingerprint_hex: str, ns: str, chunk_tokens: int, ids) -> list[str]:
    fp = bytes.fromhex(fingerprint_hex)
    parent = bytes(16)
    keys = []
    for i in range(len(ids) // chunk_tokens):
        chunk = ids[i * chunk_tokens:(i + 1) * chunk_tokens]
        parent = _h128(parent + fp + _namespace(ns) + _tokens(chunk))
        keys.append(parent.hex())
    return keys


def segment_key(fingerprint_hex: str, ns: str, ids) -> str:
    fp = bytes.fromhex(fingerprint_hex)
    return _h128(b"seg" + fp + _namespace(ns) + _tokens(ids)).hex()


# ---- kdn ---------------------------------------------------------------------

def kdn_keys(*args, ids) -> list[str]:
    if not KDN_KEYS.exists():
        pytest.fail(f"{KDN_KEYS} not found: build the kdn_keys target and set KDN_BIN_DIR")
    out = subprocess.run(
        [str(KDN_KEYS), *map(str, args), "-"],
        input=",".join(map(str, ids)), check=True, capture_output=True, text=True,
    ).stdout
    return out.split()


def random_ids(rng: random.Random, n: int) -> list[int]:
    # Mostly small ids, some at the top of the range, the extremes always.
    ids = [rng.choice((rng.randrange(0, 1 << 17), rng.randrange(0, MAX_ID + 1))) for _ in range(n)]
    if n >= 2:
        ids[rng.randrange(n)] = MAX_ID
        ids[rng.randrange(n)] = 0
    return ids


# ---- tests -------------------------------------------------------------------

def test_spec_matches_the_golden_vectors_of_the_cpp_tests():
    # The same vectors tests/kvbus/key_test.cpp and docs/kvbus.md hard-code.
    fp = FINGERPRINTS[0]
    ids = list(range(600))
    assert prefix_keys(fp, "", 256, ids) == [
        "c7f372821dabfc2fd853fa08da623fda", "6025feeff63c2e352687aa39f73ba3b6"]
    assert prefix_keys(fp, "tenant-a", 256, ids) == [
        "7118da890b978f88f9252b53ff9b2694", "66ac7c17a0a6d4e65aca03cf305a9140"]
    assert segment_key(fp, "", ids) == "34aeb3cfd5d5e2484c43ed91b04cf25f"
    assert kdn_keys("prefix", fp, "", 256, ids=ids) == prefix_keys(fp, "", 256, ids)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 16, 256, 1000])
@pytest.mark.parametrize("ns", NAMESPACES)
def test_prefix_keys_match_the_spec(chunk_tokens, ns):
    rng = random.Random(f"prefix/{chunk_tokens}/{ns}")
    for trial in range(4):
        fp = FINGERPRINTS[trial % len(FINGERPRINTS)]
        # Whole chunks, a partial last chunk, and fewer tokens than one chunk.
        n = rng.choice([chunk_tokens * rng.randrange(1, 6),
                        chunk_tokens * rng.randrange(0, 5) + rng.randrange(0, chunk_tokens),
                        rng.randrange(0, 2100)])
        ids = random_ids(rng, n)
        want = prefix_keys(fp, ns, chunk_tokens, ids)
        assert len(want) == n // chunk_tokens
        assert kdn_keys("prefix", fp, ns, chunk_tokens, ids=ids) == want, (fp, ns, n)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_segment_keys_match_the_spec(ns):
    rng = random.Random(f"segment/{ns}")
    for trial in range(6):
        fp = FINGERPRINTS[trial % len(FINGERPRINTS)]
        ids = random_ids(rng, rng.choice([0, 1, 7, 256, 1999]))
        assert kdn_keys("segment", fp, ns, ids=ids) == [segment_key(fp, ns, ids)], (fp, ns, len(ids))


def test_largest_token_id_is_hashed_as_unsigned_32_bit_little_endian():
    fp = FINGERPRINTS[0]
    ids = [MAX_ID, 0, MAX_ID, 1]
    want = _h128(b"seg" + bytes.fromhex(fp) + struct.pack("<I", 0)
                 + bytes.fromhex("ffffff7f" "00000000" "ffffff7f" "01000000")).hex()
    assert segment_key(fp, "", ids) == want
    assert kdn_keys("segment", fp, "", ids=ids) == [want]
    assert kdn_keys("prefix", fp, "", 2, ids=ids) == prefix_keys(fp, "", 2, ids)
