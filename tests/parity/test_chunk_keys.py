"""Chunk keys: kdn against an independent implementation of docs/kvbus.md.

Prefix, segment and tail keys are recomputed here from the spec alone (struct for the byte layout,
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


def tail_piece_sizes(tail_len: int) -> list[int]:
    # docs/kvbus.md, "Tail keys": one token (the anchor), then the binary
    # digits of the other tail_len - 1 tokens, largest first.
    rest = tail_len - 1
    return [1] + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


def tail_key(fingerprint_hex: str, ns: str, parent: bytes, ids) -> bytes:
    fp = bytes.fromhex(fingerprint_hex)
    return _h128(b"tail" + parent + fp + _namespace(ns) + struct.pack("<I", len(ids)) + _tokens(ids))


def tail_spans(fingerprint_hex: str, ns: str, chunk_tokens: int, ids) -> list[tuple[int, int, str]]:
    # (first, count, key hex) of each piece of the tokens past the last full
    # chunk, chained from that chunk's prefix key (16 zero bytes if none).
    full = len(ids) // chunk_tokens
    prefix = prefix_keys(fingerprint_hex, ns, chunk_tokens, ids)
    parent = bytes.fromhex(prefix[-1]) if full else bytes(16)
    pos, spans = full * chunk_tokens, []
    if pos == len(ids):
        return spans
    for size in tail_piece_sizes(len(ids) - pos):
        parent = tail_key(fingerprint_hex, ns, parent, ids[pos:pos + size])
        spans.append((pos, size, parent.hex()))
        pos += size
    assert pos == len(ids)
    return spans


# ---- kdn ---------------------------------------------------------------------

def kdn_keys(*args, ids) -> list[str]:
    if not KDN_KEYS.exists():
        pytest.fail(f"{KDN_KEYS} not found: build the kdn_keys target and set KDN_BIN_DIR")
    out = subprocess.run(
        [str(KDN_KEYS), *map(str, args), "-"],
        input=",".join(map(str, ids)), check=True, capture_output=True, text=True,
    ).stdout
    return out.split()


def kdn_tail(fp: str, ns: str, chunk_tokens: int, ids) -> list[tuple[int, int, str]]:
    words = kdn_keys("tail", fp, ns, chunk_tokens, ids=ids)
    assert len(words) % 3 == 0, words
    return [(int(words[i]), int(words[i + 1]), words[i + 2]) for i in range(0, len(words), 3)]


def random_ids(rng: random.Random, n: int) -> list[int]:
    # Mostly small ids, some at the top of the range, the extremes always.
    ids = [rng.choice((rng.randrange(0, 1 << 17), rng.randrange(0, MAX_ID + 1))) for _ in range(n)]
    if n >= 2:
        ids[rng.randrange(n)] = MAX_ID
        ids[rng.randrange(n)] = 0
    return ids


def steering_vector_key(fingerprint_hex: str, ns: str, name: str) -> str:
    fp = bytes.fromhex(fingerprint_hex)
    return _h128(b"steer-vec" + fp + _namespace(ns) + _namespace(name)).hex()


def steered_key(document_hex: str, vector_hex: str, strength: float) -> str:
    return _h128(b"steered" + bytes.fromhex(document_hex) + bytes.fromhex(vector_hex) +
                 struct.pack("<f", strength)).hex()


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
    vector = steering_vector_key(fp, "", "trust-the-text")
    assert vector == "3448a35906e5a311d3acce1f1cdbfafd"
    assert steering_vector_key(fp, "tenant-a", "trust-the-text") == "0b8c85c25ea4144fc35e1983f8a62e83"
    assert steered_key(segment_key(fp, "", ids), vector, 1.0) == "51a5aaa541d0074e4396bfc1cf167016"
    assert steered_key(segment_key(fp, "", ids), vector, 2.0) == "88814e55dec7558b2f85455c74c46ba6"
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


# ---- tail keys ---------------------------------------------------------------

# The tail golden vectors of tests/kvbus/key_test.cpp and docs/kvbus.md.
TAIL_GOLDEN = [
    # tokens 0..599, chunk_tokens 256, namespace empty: 88 tokens past chunk 1
    ((list(range(600)), "", 256), [
        (512, 1, "29ebceeee2bf877370b81e28879ed04a"),
        (513, 64, "935daff95c143c6dfa7dab35a7f8ea93"),
        (577, 16, "6b4187cfd3fffb4789d69d0fd990e0a3"),
        (593, 4, "33b5e0a2c645c310a397ce7e08c22b31"),
        (597, 2, "bd0300a257cdabe853a30aa4c08d34b2"),
        (599, 1, "7d8a1172448b7b665513e7d43867d4b3"),
    ]),
    # tokens 1..7, chunk_tokens 16, namespace "tenant-a": no full chunk, so
    # the anchor's parent is 16 zero bytes
    ((list(range(1, 8)), "tenant-a", 16), [
        (0, 1, "cc99c856111780c39d4860397e8b833c"),
        (1, 4, "d30659f3e801fd5665e90085ab094a27"),
        (5, 2, "9dda399e390a8041de03587edb3f4727"),
    ]),
]


def test_tail_spec_matches_the_golden_vectors_of_the_cpp_tests():
    fp = FINGERPRINTS[0]
    for (ids, ns, chunk_tokens), want in TAIL_GOLDEN:
        assert tail_spans(fp, ns, chunk_tokens, ids) == want
        assert kdn_tail(fp, ns, chunk_tokens, ids) == want
    # The first piece's bytes, spelled out as docs/kvbus.md does.
    anchor = (b"tail" + bytes.fromhex("6025feeff63c2e352687aa39f73ba3b6") + bytes.fromhex(fp)
              + bytes.fromhex("00000000" "01000000" "00020000"))
    assert len(anchor) == 48
    assert _h128(anchor).hex() == TAIL_GOLDEN[0][1][0][2]


def test_tail_piece_sizes_follow_the_rule():
    # Checked against kdn's own spans for every tail length of one chunk size,
    # independently of the key bytes.
    assert tail_piece_sizes(1) == [1]
    assert tail_piece_sizes(2) == [1, 1]
    assert tail_piece_sizes(88) == [1, 64, 16, 4, 2, 1]
    assert tail_piece_sizes(255) == [1, 128, 64, 32, 16, 8, 4, 2]
    assert tail_piece_sizes(256) == [1, 128, 64, 32, 16, 8, 4, 2, 1]
    fp, chunk_tokens = FINGERPRINTS[0], 64
    for full in (0, 2):
        for tail_len in range(chunk_tokens):
            ids = list(range(full * chunk_tokens + tail_len))
            spans = kdn_tail(fp, "", chunk_tokens, ids)
            if tail_len == 0:
                assert spans == []
                continue
            counts = [c for _, c, _ in spans]
            assert counts[0] == 1
            rest = counts[1:]
            assert sum(counts) == tail_len
            assert rest == sorted(rest, reverse=True) and len(set(rest)) == len(rest)
            assert all(c & (c - 1) == 0 for c in rest)  # powers of two
            assert sum(rest) == tail_len - 1
            # Contiguous, from the end of the last full chunk to the end.
            pos = full * chunk_tokens
            for first, count, _ in spans:
                assert first == pos
                pos += count
            assert pos == len(ids)


@pytest.mark.parametrize("chunk_tokens", [2, 3, 16, 64, 100, 256])
@pytest.mark.parametrize("ns", NAMESPACES)
def test_tail_keys_match_the_spec(chunk_tokens, ns):
    rng = random.Random(f"tail/{chunk_tokens}/{ns}")
    for trial in range(5):
        fp = FINGERPRINTS[trial % len(FINGERPRINTS)]
        # No full chunk, some full chunks, and a tail at either extreme.
        full = rng.choice([0, 0, 1, rng.randrange(2, 5)])
        tail_len = rng.choice([1, chunk_tokens - 1, rng.randrange(0, chunk_tokens)])
        ids = random_ids(rng, full * chunk_tokens + tail_len)
        want = tail_spans(fp, ns, chunk_tokens, ids)
        assert sum(c for _, c, _ in want) == tail_len
        assert kdn_tail(fp, ns, chunk_tokens, ids) == want, (fp, ns, full, tail_len)


@pytest.mark.parametrize("ns", ["", "tenant-a", "東京"])
def test_every_tail_length_of_a_small_chunk_matches_the_spec(ns):
    chunk_tokens = 16
    rng = random.Random(f"tail-every/{ns}")
    for full in (0, 1, 3):
        for tail_len in range(chunk_tokens):
            fp = FINGERPRINTS[tail_len % len(FINGERPRINTS)]
            ids = random_ids(rng, full * chunk_tokens + tail_len)
            assert kdn_tail(fp, ns, chunk_tokens, ids) == tail_spans(fp, ns, chunk_tokens, ids), (full, tail_len)


def test_tail_keys_chain_and_separate():
    # A tail piece's key names its whole prefix: changing any earlier token
    # (in a full chunk or in an earlier piece) changes every later piece's
    # key; the namespace and the fingerprint separate tails as they do chunks.
    fp, chunk_tokens = FINGERPRINTS[0], 16
    ids = list(range(2 * chunk_tokens + 12))  # tail 12: pieces 1, 8, 2, 1
    base = tail_spans(fp, "", chunk_tokens, ids)
    assert [c for _, c, _ in base] == [1, 8, 2, 1]
    for changed in (0, 20, 32, 33, 40, 41, 43):
        other = list(ids)
        other[changed] += 1000
        keys = tail_spans(fp, "", chunk_tokens, other)
        for (first, count, key), (_, _, old) in zip(keys, base):
            assert (key == old) == (first + count <= changed), (changed, first)
    assert kdn_tail(fp, "tenant-a", chunk_tokens, ids)[0][2] != base[0][2]
    assert kdn_tail(FINGERPRINTS[1], "", chunk_tokens, ids)[0][2] != base[0][2]


def test_no_tail_on_a_chunk_boundary_or_with_one_token_chunks():
    fp = FINGERPRINTS[0]
    assert kdn_tail(fp, "", 16, list(range(32))) == []
    assert kdn_tail(fp, "", 16, []) == []
    assert kdn_tail(fp, "", 1, list(range(5))) == []
