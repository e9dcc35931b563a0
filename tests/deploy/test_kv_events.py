"""KV events (docs/serving.md, "KV events"): each worker of `kdn-launch up
--kv-events-port` publishes what its host tier gains and drops in vLLM's
KV-events wire format. msgpack (PyPI's, nobody here wrote it) decodes every
batch; with KDN_KV_EVENTS_VLLM=1 (scripts/test-vllm.sh, in vLLM's
environment) vLLM's own event classes do (vllm.distributed.kv_events). pyzmq
is the subscriber and the replay client. A router following the streams,
keying blocks its own way (by their tokens from the prompt's start, rebuilt
from token_ids and parent_block_hash), predicts the cached tokens kdn
reports for a prompt it has not seen. The prompts are token ids.
"""

import os
import random
import socket

import httpx
import pytest
import zmq

if os.environ.get("KDN_KV_EVENTS_VLLM") == "1":
    import msgspec
    from vllm.distributed import kv_events as vllm_events

    VLLM_BATCH = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    VLLM_SKIPS = {"kdn_chunk_keys"}  # a field vLLM's classes do not have
else:
    import msgpack

    VLLM_BATCH = None
    VLLM_SKIPS = set()

from deploy_util import CHUNK_TOKENS, Deployment, metric, parse_metrics, wait_until

END = (-1).to_bytes(8, "big", signed=True)


def free_ports(n):
    """A first port of n consecutive ports free now on loopback."""
    for base in range(20000 + random.Random().randrange(0, 20000, 2), 60000, 2):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no %d free consecutive ports" % n)


def replay(ctx, endpoint, start=0):
    """Every batch the worker keeps from `start`: [(seq, payload bytes)]."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 30000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            empty, topic, seq, payload = s.recv_multipart()
            assert empty == b""
            if seq == END:
                assert topic == b"" and payload == b""
                return out
            assert topic == b"", topic  # vLLM's default topic
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        s.close()


def vllm_decode(payload):
    """The batch as vLLM's classes read it, in the form msgpack gives: the
    fields kdn sends, each optional one vLLM has that kdn does not send at
    its default."""
    b = VLLM_BATCH.decode(payload)
    assert b.data_parallel_rank == 0
    events = []
    for e in b.events:
        d = {"type": type(e).__name__}
        if isinstance(e, vllm_events.BlockStored):
            d.update(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                     token_ids=e.token_ids, block_size=e.block_size, lora_id=e.lora_id,
                     medium=e.medium, lora_name=e.lora_name)
            assert (e.extra_keys, e.group_idx, e.locality, e.session_id) == (None,) * 4, e
        elif isinstance(e, vllm_events.BlockRemoved):
            d.update(block_hashes=e.block_hashes, medium=e.medium)
            assert (e.group_idx, e.locality) == (None, None), e
        else:
            assert isinstance(e, vllm_events.AllBlocksCleared), e
        events.append(d)
    return [b.ts, events, b.data_parallel_rank]


def decode(payload):
    """vLLM's KVEventBatch as its publisher sends it: [ts, events, rank 0],
    each event a map tagged by type, block hashes ints."""
    batch = vllm_decode(payload) if VLLM_BATCH else msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3 and batch[2] == 0, batch
    ts, events, _ = batch
    assert isinstance(ts, float) and ts > 1.6e9, ts
    for e in events:
        assert e["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared"), e
        if e["type"] == "BlockStored":
            assert set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids",
                              "block_size", "lora_id", "medium", "lora_name",
                              "kdn_chunk_keys"} - VLLM_SKIPS, e
            assert e["block_size"] == CHUNK_TOKENS, e
            assert len(e["token_ids"]) == CHUNK_TOKENS * len(e["block_hashes"]), e
            # CPU: the worker's host tier; STORAGE: written to its shared tier.
            assert e["medium"] in ("CPU", "STORAGE") and e["lora_id"] is None and \
                e["lora_name"] is None, e
            parent = e["parent_block_hash"]
            assert parent is None or (isinstance(parent, int) and 0 <= parent < 2**64), e
        if e["type"] in ("BlockStored", "BlockRemoved"):
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in e["block_hashes"]), e
            if not VLLM_BATCH:
                # kdn's whole keys, each block's hash their first 8 bytes.
                keys = e["kdn_chunk_keys"]
                assert [int.from_bytes(k[:8], "big") for k in keys] == e["block_hashes"], e
    return ts, events


class Index:
    """What a router following the workers' streams knows: each worker's
    blocks, keyed by their tokens from the prompt's start."""

    def __init__(self):
        self.own = {}    # kdn's block hash -> the tokens from the prompt's start
        self.held = {}   # worker -> set of those token tuples

    def apply(self, worker, events):
        held = self.held.setdefault(worker, set())
        for e in events:
            if e["type"] == "AllBlocksCleared":
                held.clear()
            elif e["type"] == "BlockStored":
                parent = e["parent_block_hash"]
                prefix = () if parent is None else self.own[parent]
                bs = e["block_size"]
                for i, h in enumerate(e["block_hashes"]):
                    prefix = prefix + tuple(e["token_ids"][i * bs:(i + 1) * bs])
                    self.own[h] = prefix
                    held.add(prefix)
            else:
                for h in e["block_hashes"]:
                    held.discard(self.own[h])

    def cached(self, ids):
        """The leading full blocks of `ids` some worker holds, in tokens."""
        n = 0
        while n + CHUNK_TOKENS <= len(ids) and any(
                tuple(ids[:n + CHUNK_TOKENS]) in h for h in self.held.values()):
            n += CHUNK_TOKENS
        return n


def index_of(ctx, replay_endpoints):
    """An Index of every batch the workers keep, merged in time order (a
    block's parent may come from another worker's stream)."""
    batches = []
    for worker, ep in replay_endpoints.items():
        for seq, payload in replay(ctx, ep):
            ts, events = decode(payload)
            batches.append((ts, worker, seq, events))
    batches.sort(key=lambda b: (b[0], b[2]))
    index = Index()
    for _, worker, _, events in batches:
        index.apply(worker, events)
    return index


@pytest.fixture(scope="module")
def events_deployment(tiny_model, tmp_path_factory):
    base = free_ports(4)
    d = Deployment(tmp_path_factory.mktemp("run-events"), tiny_model, "--store",
                   "--store-host-mib", 64, "--kv-events-port", base)
    d.events = {"prefill-0": "tcp://127.0.0.1:%d" % base,
                "decode-0": "tcp://127.0.0.1:%d" % (base + 2)}
    d.replays = {"prefill-0": "tcp://127.0.0.1:%d" % (base + 1),
                 "decode-0": "tcp://127.0.0.1:%d" % (base + 3)}
    try:
        yield d
    finally:
        d.down()


def test_a_router_following_the_events_predicts_the_cached_tokens(events_deployment):
    d = events_deployment
    ctx = zmq.Context()
    try:
        rng = random.Random(20261207)
        a = [rng.randrange(3, 256) for _ in range(2 * CHUNK_TOKENS + 88)]
        r = d.completion(a, max_tokens=4, temperature=0, ignore_eos=True,
                         disaggregation="always")
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r["usage"]
        # The prompt's chunks are stored off the request's path: wait for
        # their events.
        index = wait_until(lambda: (lambda i: i if i.cached(a) == 2 * CHUNK_TOKENS else None)(
            index_of(ctx, d.replays)), timeout=60)
        assert index is not None, "the prompt's two full chunks were never announced"
        # Written through to the deployment's kdn-store too: announced as
        # stored there (medium STORAGE) by the worker that wrote them.
        def storage_blocks():
            return [e["token_ids"] for ep in d.replays.values() for _, p in replay(ctx, ep)
                    for e in decode(p)[1]
                    if e["type"] == "BlockStored" and e["medium"] == "STORAGE"]
        assert wait_until(lambda: a[:CHUNK_TOKENS] in storage_blocks(), timeout=60), \
            "the chunks written to the shared tier were never announced"
        # Each stream starts with AllBlocksCleared (batch 0).
        for ep in d.replays.values():
            seq, payload = replay(ctx, ep)[0]
            assert seq == 0 and decode(payload)[1] == [{"type": "AllBlocksCleared"}]

        # A prompt kdn has not seen, sharing the first two chunks; and one
        # sharing nothing.
        b = a[:2 * CHUNK_TOKENS] + [rng.randrange(3, 256) for _ in range(100)]
        c = [rng.randrange(3, 256) for _ in range(CHUNK_TOKENS + 10)]
        for prompt, want in ((b, 2 * CHUNK_TOKENS), (c, 0)):
            predicted = index.cached(prompt)
            assert predicted == want
            r = d.completion(prompt, max_tokens=1, temperature=0, disaggregation="always")
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted, r["usage"]
    finally:
        ctx.destroy(linger=0)


def test_the_live_stream_is_the_replayed_one(events_deployment):
    d = events_deployment
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(d.events["prefill-0"])
        rng = random.Random(7)
        live = []
        # A subscriber sees what is sent after it joined: new prompts until
        # a batch reaches it.
        for _ in range(50):
            ids = [rng.randrange(3, 256) for _ in range(CHUNK_TOKENS + 5)]
            d.completion(ids, max_tokens=1, temperature=0, disaggregation="always")
            try:
                live.append(sub.recv_multipart())
                break
            except zmq.Again:
                continue
        assert live, "no batch reached the subscriber"
        sub.setsockopt(zmq.RCVTIMEO, 30000)
        ids = [rng.randrange(3, 256) for _ in range(CHUNK_TOKENS + 5)]
        d.completion(ids, max_tokens=1, temperature=0, disaggregation="always")
        first = int.from_bytes(live[0][1], "big")
        # Every batch after the first, numbered in order, up to the one that
        # announces the last prompt's chunk.
        while not any(e["type"] == "BlockStored" and e["token_ids"] == ids[:CHUNK_TOKENS]
                      for e in decode(live[-1][2])[1]):
            live.append(sub.recv_multipart())
        seqs = [int.from_bytes(m[1], "big") for m in live]
        assert seqs == list(range(first, first + len(live))), seqs
        kept = dict(replay(ctx, d.replays["prefill-0"], start=first))
        for topic, seq, payload in live:
            assert topic == b""
            assert kept[int.from_bytes(seq, "big")] == payload
    finally:
        ctx.destroy(linger=0)


def test_a_full_host_tier_announces_what_it_drops(tiny_model, tmp_path_factory):
    # A host tier of three of the tiny model's chunks (128 KiB each, with
    # room for tail pieces), no shared tier: three prompts of two chunks
    # each make it drop the first prompt's.
    base = free_ports(4)
    d = Deployment(tmp_path_factory.mktemp("run-events-small"), tiny_model,
                   "--host-mib", 0.5, "--kv-events-port", base)
    ctx = zmq.Context()
    try:
        replay_ep = {"prefill-0": "tcp://127.0.0.1:%d" % (base + 1)}
        rng = random.Random(11)
        prompts = [[rng.randrange(3, 256) for _ in range(2 * CHUNK_TOKENS + 3)]
                   for _ in range(3)]
        for ids in prompts:
            d.completion(ids, max_tokens=1, temperature=0, disaggregation="always")

        def removed():
            events = [e for _, p in replay(ctx, replay_ep["prefill-0"]) for e in decode(p)[1]]
            return [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]

        # The first prompt's chunks went first (least recently used); the
        # last prompt's are held, once their stores (off the requests' path)
        # are announced.
        def settled():
            i = index_of(ctx, replay_ep)
            return i if (i.cached(prompts[0]), i.cached(prompts[2])) == (0, 2 * CHUNK_TOKENS) \
                else None

        index = wait_until(settled, timeout=60)
        assert index is not None, (index_of(ctx, replay_ep).cached(prompts[0]),
                                   index_of(ctx, replay_ep).cached(prompts[2]))
        assert len(removed()) >= 2, "the host tier's evictions were never announced"
    finally:
        ctx.destroy(linger=0)
        d.down()


def test_routers_take_prefixes_from_the_workers_event_streams(tiny_model, tmp_path_factory):
    """`--lookups-from-events` (docs/serving.md, "Lookups from the event
    stream"): two routers follow the three workers' streams; a prefix one
    router's request left at one of two prefill workers is found by the
    other router from its own index, no worker asked, and served there."""
    base = free_ports(6)
    d = Deployment(tmp_path_factory.mktemp("run-events-lookups"), tiny_model, "--prefill", 2,
                   "--kv-events-port", base, "--lookups-from-events", "--routers", 2,
                   "--disaggregation", "always")
    other = httpx.Client(base_url=d.info["urls"][1], timeout=httpx.Timeout(60.0))
    try:
        def workers(client):
            return client.get("/health").json()["workers"]

        def synced(client):
            return all(w.get("kv_events", {}).get("synced") for w in workers(client))

        assert wait_until(lambda: synced(d.http) and synced(other), timeout=60), \
            workers(other)
        rng = random.Random(20261208)
        a = [rng.randrange(3, 256) for _ in range(2 * CHUNK_TOKENS + 40)]
        first = d.completion(a, max_tokens=2, temperature=0, ignore_eos=True)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first["usage"]
        # The chunks are stored off the request's path: the second router
        # learns of them from the prefill worker's stream. It must also have
        # a report of that worker from after the request: one taken while it
        # computed the prompt still counts it queued there, and placement
        # would send the next request to the other prefill worker.
        def learned(ws):
            prefill = [w for w in ws if w["role"] == "prefill"]
            return (any(w["kv_events"]["blocks"] >= 2 for w in prefill) and
                    all(w["queue_depth"] == 0 for w in prefill))
        assert wait_until(lambda: learned(workers(other)), timeout=60), workers(other)
        before = parse_metrics(other.get("/metrics").text)
        b = a[:2 * CHUNK_TOKENS] + [rng.randrange(3, 256) for _ in range(30)]
        r = other.post("/v1/completions", json=dict(prompt=b, max_tokens=2, temperature=0,
                                                     ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * CHUNK_TOKENS, \
            r.json()["usage"]
        after = parse_metrics(other.get("/metrics").text)
        asked = (metric(after, "kdn_lookups_total", answered="worker") -
                 metric(before, "kdn_lookups_total", answered="worker"))
        from_events = (metric(after, "kdn_lookups_total", answered="events") -
                       metric(before, "kdn_lookups_total", answered="events"))
        assert (asked, from_events) == (0, 3), (asked, from_events)
    finally:
        other.close()
        d.down()
