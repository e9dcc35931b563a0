"""CURVE on the internal sockets (docs/kvbus.md, "Authenticated sockets"): a
deployment from `kdn-launch up --store`, which writes the members' and the
router's keys into its run folder. pyzmq plays the outsider: a peer without a
key, or with a keypair of its own, gets no answer from kdn-store, cannot
prepare on the decode worker (its free KV blocks stay where they were) and
crashes nothing, not even with every input of the fuzz tests' corpora sent to
every internal socket; a holder of the members' key reaches kdn-store but cannot
prepare either: only the router's key can. The answered probes show the
probes are well formed.
"""

import re
import struct
import time
from pathlib import Path

import pytest
import zmq

from deploy_util import Deployment, metric, parse_metrics, pid_alive


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number, payload):
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def prepare(request_id, tokens=64):
    """proto/serving.proto WorkerMessage{request_id, prepare{tokens, sampling,
    max_tokens, transfer_id}}: what took a decode worker's KV to 0 blocks
    before CURVE."""
    body = field(1, b"".join(varint(t) for t in range(1, tokens + 1)))
    body += field(3, varint(3 << 3 | 5) + struct.pack("<f", 1.0))  # sampling{top_p: 1}
    body += varint(4 << 3) + varint(512) + field(7, b"forged-%09d" % request_id)
    return varint(1 << 3) + varint(request_id) + field(6, body)


def cancel(request_id):
    return varint(1 << 3) + varint(request_id) + field(12, b"")


# The fuzz tests' corpora (tests/fuzz/corpus): inputs each harness feeds a
# parser or handler, here sent whole as frames by peers without the key.
CORPUS = Path(__file__).resolve().parent.parent / "fuzz" / "corpus"


def corpus_frames():
    return [f.read_bytes() for d in ("worker", "store", "wire", "chunk", "kvc")
            for f in sorted((CORPUS / d).iterdir()) if f.is_file()]


# proto/kvbus_store.proto StoreRequest{id: 7, stats{}}.
STORE_STATS = varint(1 << 3) + varint(7) + field(5, b"")


@pytest.fixture(scope="module")
def secured(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-curve"), tiny_model, "--store")
    try:
        yield d
    finally:
        d.down()


def read_key(d, name):
    text = (d.run_dir / name).read_text()
    return {k: v.encode() for k, v in
            re.findall(r"^(public-key|secret-key|server-key|router-key) = (\S+)$", text, re.M)}


def endpoint(d, name):
    return next(p["endpoint"] for p in d.info["processes"] if p["name"] == name)


def kvbus_endpoint(d, name):
    """Where decode worker `name` takes KV, from its start-up log line."""
    log = next(p["log"] for p in d.info["processes"] if p["name"] == name)
    m = re.search(r"KV in on (tcp://\S+)", Path(log).read_text(errors="replace"))
    assert m, "no 'KV in on' line in %s" % log
    return m.group(1)


def dealer(ctx, ep, server_key=None, keypair=None):
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    if server_key is not None:
        s.curve_serverkey = server_key
        s.curve_publickey, s.curve_secretkey = keypair
    s.connect(ep)
    return s


def send(sock, frames):
    """Queues `frames` if ZeroMQ takes them: a connection refused at the
    handshake leaves a DEALER no peer to queue for."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass


def answered(sock, frames, timeout_ms):
    send(sock, frames)
    return sock.poll(timeout_ms, zmq.POLLIN) != 0


def free_blocks(d):
    return metric(parse_metrics(d.metrics()), "kdn_worker_free_kv_blocks", worker="decode-0",
                  role="decode")


def test_the_keys_are_private_and_every_process_holds_its_own(secured):
    for name in ("curve.key", "router.key"):
        assert (secured.run_dir / name).stat().st_mode & 0o777 == 0o600
    for p in secured.info["processes"]:
        key = secured.run_dir / ("router.key" if p["name"] == "router" else "curve.key")
        assert p["cmd"][p["cmd"].index("--curve-keys") + 1] == str(key.resolve()), p["cmd"]
    members, router = read_key(secured, "curve.key"), read_key(secured, "router.key")
    assert members["router-key"] == router["public-key"]
    assert router["server-key"] == members["public-key"]
    assert "secret-key" in router and router["secret-key"] != members["secret-key"]


def test_outsiders_cannot_prepare_or_reach_the_store(secured):
    key, router_key = read_key(secured, "curve.key"), read_key(secured, "router.key")
    ctx = zmq.Context()
    try:
        before = free_blocks(secured)
        assert before > 0
        outsiders = [dict(), dict(server_key=key["public-key"], keypair=zmq.curve_keypair())]
        for i, who in enumerate(outsiders):
            decode = dealer(ctx, endpoint(secured, "decode-0"), **who)
            for n in range(40):
                send(decode, [prepare(1000 * (i + 1) + n)])
            assert not answered(decode, [prepare(999 + i)], 1000)
            decode.close()
            store = dealer(ctx, endpoint(secured, "store"), **who)
            assert not answered(store, [STORE_STATS], 1000)
            # What the fuzz tests feed the parsers, from outside the key.
            for frames in ([b""], [b"\xff" * 70000], [STORE_STATS, b"not a chunk"],
                           [b"\x08\x01\x22\x00", b"KDNC" + b"\x00" * 200]):
                send(store, frames)
            store.close()
            # Every fuzz corpus input, to every internal socket.
            frames = corpus_frames()
            assert len(frames) >= 20, CORPUS
            for ep in (endpoint(secured, "decode-0"), endpoint(secured, "prefill-0"),
                       endpoint(secured, "store"), kvbus_endpoint(secured, "decode-0")):
                s = dealer(ctx, ep, **who)
                for f in frames:
                    send(s, [f])
                    send(s, [f, f])
                assert not answered(s, [STORE_STATS], 300)
                s.close()
        # A holder of the members' key (a worker) reaches the store but not
        # a control socket: only the router prepares.
        member = dict(server_key=key["public-key"], keypair=(key["public-key"],
                                                             key["secret-key"]))
        decode = dealer(ctx, endpoint(secured, "decode-0"), **member)
        assert not answered(decode, [prepare(998)], 1000)
        decode.close()
        time.sleep(0.5)
        assert free_blocks(secured) == before
        store = dealer(ctx, endpoint(secured, "store"), **member)
        assert answered(store, [STORE_STATS], 5000)
        store.close()
        router = dict(server_key=router_key["server-key"],
                      keypair=(router_key["public-key"], router_key["secret-key"]))
        decode = dealer(ctx, endpoint(secured, "decode-0"), **router)
        assert answered(decode, [prepare(42)], 5000)
        # PrepareReply{} with no error: it reserved; then let it go.
        assert decode.recv() == varint(1 << 3) + varint(42) + field(7, b"")
        decode.send(cancel(42))
        decode.close()
    finally:
        ctx.destroy(linger=0)
    # Nothing crashed; the deployment serves, and its logs name the refusals.
    assert all(pid_alive(p["pid"]) for p in secured.info["processes"])
    out = secured.completion("The outsiders knocked", max_tokens=4)
    assert out["choices"][0]["text"] is not None
    logs = {p["name"]: open(p["log"], errors="replace").read() for p in secured.info["processes"]}
    for name in ("store", "decode-0"):
        assert "does not hold the deployment's CURVE key" in logs[name], logs[name][-2000:]
