"""kdn's KDN shared with transformers (docs/clients.md), through the Python
package `kdn` over libkdn_client, on SmolLM2-135M-Instruct (the Q4_1 GGUF a
kdn deployment serves; transformers runs the folder the gguf package's
dequantized tensors make of it, fp32):

  - kdn's prefill worker stores a prompt of several chunks and a tail in
    kdn-store; transformers looks it up, fetches it into a DynamicCache and
    decodes greedily: the tokens of its own full prefill, with the hit the
    KDN's lookup spec gives and KV close to its own;
  - transformers stores a prompt; a kdn request with it reports those
    tokens as cached_tokens and answers as kdn-generate does;
  - negative controls: a chunk changed in the store (a Redis value, edited
    with redis-cli) is a miss from there on, never wrong tokens; another
    model fingerprint misses; a layout that does not fit is refused.

Runs with the transformers of .venv-ref (CI's) and of scripts/vllm-env.sh's
environment (the current one; scripts/test-vllm.sh runs it there too).
"""

import json
import logging
import os
import re
import signal
import threading
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "deploy"))
sys.path.insert(0, str(HERE.parent / "parity"))
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parents[1] / "launch"))
sys.path.insert(0, str(HERE))
from kdn_launch import redis_cluster  # noqa: E402
from redis_shards import no_process_shows, prompts_on  # noqa: E402
from deploy_util import BIN_DIR, Deployment, generate_ids, repeat_cached, wait_until  # noqa: E402
from gguf_micro import smollm2_path  # noqa: E402
from llama_cpp_tokenize import llama_cpp_ids  # noqa: E402
from test_gguf import hf_folder  # noqa: E402
from prompts import text  # noqa: E402
from test_blend import blend_text, details, inject  # noqa: E402

os.environ.setdefault("KDN_LIB_DIR", str(BIN_DIR.parent / "lib"))
import kdn  # noqa: E402
import kdn.hf  # noqa: E402

CHUNK = 256
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_path()


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory):
    folder = hf_folder(gguf.GGUFReader(str(smollm2)), tmp_path_factory.mktemp("smollm2-hf"))
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                             attn_implementation="eager").eval()
    return model


@pytest.fixture(scope="module")
def deployment(smollm2, tmp_path_factory):
    # f32 weights: transformers' fp32 arithmetic, whose KV kdn's must match.
    d = Deployment(tmp_path_factory.mktemp("run-clients"), smollm2, "--store",
                   "--store-host-mib", 256, "--weights-dtype", "f32")
    try:
        yield d
    finally:
        d.down()


@pytest.fixture(scope="module")
def client(smollm2, deployment):
    store = next(p for p in deployment.info["processes"] if p["role"] == "store")
    uri = "kdn-store://" + store["endpoint"][len("tcp://"):]
    model = kdn.Model(smollm2, kv_dtype="f32")  # kdn's CPU worker keeps f32 KV
    c = kdn.Client(uri, model, curve_keys=str(deployment.run_dir / "curve.key"),
                   chunk_tokens=CHUNK)
    yield c
    c.close()


def greedy(model, ids, cache=None):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(x), pad_token_id=2)
    return out[0, len(ids):].tolist()


def full_cache(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values


def kdn_serve(d, ids, max_tokens):
    r = d.completion(ids, max_tokens=max_tokens, temperature=0)
    return r, r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_the_packages_dtype_table_is_the_c_headers():
    """kdn.DTYPES mirrors kdn_dtype (kdn/client.h), which client.cpp checks
    against kdn::DType value for value."""
    header = (HERE.parents[1] / "client" / "include" / "kdn" / "client.h").read_text()
    body = re.search(r"typedef enum kdn_dtype \{([^}]*)\}", header).group(1)
    values = {}
    for entry in body.split(","):
        name, value = (s.strip() for s in entry.split("="))
        values[name.removeprefix("KDN_").lower()] = int(value)
    assert kdn.DTYPES == values
    assert {v: s for v, s in kdn._ITEMSIZE.items()} == {0: 4, 1: 2, 2: 2}


def test_transformers_reads_what_kdn_stored(smollm2, reference, deployment, client):
    ids = llama_cpp_ids(smollm2, [text(1, 14)])[0]
    assert 3 * CHUNK < len(ids) < 4 * CHUNK and len(ids) % CHUNK >= 17, len(ids)
    assert client.lookup(ids) == 0
    kdn_serve(deployment, ids, 1)
    # The prefill worker stored the prompt's chunks and tail; the decode
    # worker the conversation (the prompt, with max_tokens 1).
    assert wait_until(lambda: client.lookup(ids) == len(ids), 30), client.lookup(ids)
    # fetch_cache leaves the last prompt token to compute: the rest is cached.
    cache, cached = kdn.hf.fetch_cache(reference, ids, client)
    assert cached == len(ids) - 1
    # The KV kdn computed is transformers' own, up to rounding.
    own = kdn.hf._layer_kv(full_cache(reference, ids))
    for layer, (k, v) in enumerate(kdn.hf._layer_kv(cache)):
        assert k.shape == (1, client.model.kv_heads, cached, client.model.head_dim)
        torch.testing.assert_close(k, own[layer][0][:, :, :cached], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(v, own[layer][1][:, :, :cached], atol=2e-3, rtol=1e-3)
    kdn.hf.attach(reference, client)  # the client fetch_cache uses when given none
    cache, _ = kdn.hf.fetch_cache(reference, ids)
    assert greedy(reference, ids, cache) == greedy(reference, ids)


def test_kdn_reads_what_transformers_stored(smollm2, reference, deployment, client):
    ids = llama_cpp_ids(smollm2, [text(2, 10)])[0]
    assert 2 * CHUNK < len(ids) < 3 * CHUNK, len(ids)
    assert client.lookup(ids) == 0
    r = kdn.hf.store_cache(reference, ids, full_cache(reference, ids), client)
    spans = client.spans(ids)
    assert (r.stored, r.already_held, r.not_stored) == (len(spans), 0, 0)
    assert client.lookup(ids) == len(ids)

    out, cached = kdn_serve(deployment, ids, NEW_TOKENS)
    assert cached == repeat_cached(len(ids), 1)
    assert cached > 2 * CHUNK
    ref = generate_ids(smollm2, ids, NEW_TOKENS, "--weights-dtype", "f32")
    assert out["choices"][0]["text"].encode() == ref


def test_documents_and_an_erratum_edit_cross_between_kdn_and_transformers(smollm2, reference,
                                                                          deployment, client):
    """A document kdn injected is fetched whole as transformers' own KV; one
    transformers stored, and its erratum edit made with transformers
    (kdn.hf.store_erratum), are blended by a kdn request from the KDN, which
    then answers as kdn-generate computing them itself does."""
    texts = ["The lighthouse keeper of Orlem island is named Tavi. " + text(3, 2),
             "Tavi keeps bees on the north cliff. " + text(4, 2)]
    note = "Note: Tavi keeps goats, not bees."
    question = "\nQuestion: Who keeps the lighthouse of Orlem?\nAnswer:"
    docs = llama_cpp_ids(smollm2, texts)
    note_ids = llama_cpp_ids(smollm2, [note])[0]
    inject(deployment, [texts[0]])
    assert wait_until(lambda: client.has_document(docs[0]), 30)
    fetched = kdn.hf.fetch_document(reference, docs[0], client)
    own = kdn.hf._layer_kv(full_cache(reference, docs[0]))
    for layer, (k, v) in enumerate(kdn.hf._layer_kv(fetched)):
        torch.testing.assert_close(k, own[layer][0], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(v, own[layer][1], atol=2e-3, rtol=1e-3)
    assert kdn.hf.fetch_document(reference, docs[1], client) is None
    assert client.lookup(docs[0]) == 0  # a document is not a prompt's prefix

    assert not kdn.hf.store_document(reference, docs[1], full_cache(reference, docs[1]), client)
    assert kdn.hf.store_document(reference, docs[1], full_cache(reference, docs[1]), client)
    assert not kdn.hf.store_erratum(reference, docs[1], note_ids, client)
    with pytest.raises(ValueError):
        kdn.hf.store_erratum(reference, note_ids, docs[1], client)  # no such original

    f32 = ("--weights-dtype", "f32")
    selection = "boundary+deviation:8"
    for documents, errata in (([texts[0], texts[1]], None),
                              ([texts[0], {"text": texts[1], "erratum": note}], {1: note})):
        r = deployment.completion(question, documents=documents, max_tokens=NEW_TOKENS,
                                  temperature=0, blend_selection=selection)
        blended = len(docs[0]) + len(docs[1]) + (len(note_ids) if errata else 0)
        assert details(r["usage"])["blended_tokens"] == blended, r["usage"]
        want, _ = blend_text(smollm2, texts, question, NEW_TOKENS, selection, errata=errata,
                             extra=f32)
        assert r["choices"][0]["text"] == want, errata


STEERING_PAIRS = [
    ("The capital of Brivia is Tolmen. Note: this text is right.",
     "The capital of Brivia is Tolmen. Note: this text is wrong."),
    ("The river Aldo flows into the Kesh sea. Note: this text is right.",
     "The river Aldo flows into the Kesh sea. Note: this text is wrong."),
    ("Marta Ilves wrote the novel Grey Harbour. Note: this text is right.",
     "Marta Ilves wrote the novel Grey Harbour. Note: this text is wrong."),
    ("The Ostrel bird eats only seeds. Note: this text is right.",
     "The Ostrel bird eats only seeds. Note: this text is wrong."),
]


def test_a_steering_vector_and_a_steered_document_cross_between_kdn_and_transformers(
        smollm2, reference, deployment, client, tmp_path):
    """A steering vector kdn makes (POST /v1/kdn/steering) is the mean value
    difference transformers computes at its pairs' last tokens; a steer edit
    stores the document's steered version beside the original, which the
    client library fetches as the original plus strength x vector at the
    document's last token; a request naming that version answers as
    kdn-generate --steer does, and not as the plain document does."""
    name, strength = "trust-the-text", 4
    body = {"name": name, "pairs": [{"positive": p, "negative": n} for p, n in STEERING_PAIRS]}
    r = deployment.http.post("/v1/kdn/steering", json=body, timeout=120.0)
    assert r.status_code == 200, r.text[:300]
    made = r.json()
    assert (made["object"], made["name"], made["pairs"]) == ("kdn.steering_vector", name, 4), made
    assert made["layers"] == list(range(10, 20)) and not made["already_held"], made
    assert deployment.http.post("/v1/kdn/steering", json=body).json()["already_held"]
    other = dict(body, pairs=body["pairs"][:2])
    r = deployment.http.post("/v1/kdn/steering", json=other)
    assert r.status_code == 409 and r.json()["error"]["param"] == "name", r.text[:300]

    layers, values = client.steering_vector(name)
    assert layers == list(range(10, 20))
    assert client.steering_vector("no-such-vector", failure="miss") is None
    diffs = []
    for positive, negative in STEERING_PAIRS:
        rows = []
        for prompt in (positive, negative):
            ids = llama_cpp_ids(smollm2, [prompt], add_special=True)[0]
            own = kdn.hf._layer_kv(full_cache(reference, ids))
            rows.append(torch.stack([own[layer][1][0, :, -1, :] for layer in layers]))
        diffs.append(rows[0] - rows[1])
    want = torch.stack(diffs).mean(0).numpy()
    np.testing.assert_allclose(values, want, atol=2e-3, rtol=1e-3)

    doc = ("The lighthouse keeper of Orlem island is named Tavi. "
           "She rows to the mainland every Sunday.")
    question = "\nQuestion: Who keeps the lighthouse of Orlem?\nAnswer:"
    doc_ids = llama_cpp_ids(smollm2, [doc])[0]
    steer = {"vector": name, "strength": strength}
    r = deployment.http.post("/v1/kdn/edit", json={"document": doc, "steer": steer})
    assert r.status_code == 400 and r.json()["error"]["param"] == "document", r.text[:300]
    inject(deployment, [doc])
    r = deployment.http.post("/v1/kdn/edit", json={"document": doc, "steer": dict(steer,
                                                                               vector="nope")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "steer.vector", r.text[:300]
    r = deployment.http.post("/v1/completions", json={
        "prompt": question, "documents": [{"text": doc, "steer": steer}], "max_tokens": 8})
    assert r.status_code == 400 and "/v1/kdn/edit" in r.json()["error"]["message"], r.text[:300]
    r = deployment.http.post("/v1/kdn/edit", json={"document": doc, "steer": steer},
                             timeout=120.0)
    assert r.status_code == 200, r.text[:300]
    e = r.json()
    assert (e["edit"], e["steer"], e["document_tokens"]) == ("steer", steer, len(doc_ids)), e

    original = client.fetch_document(doc_ids)
    steered = client.fetch_document(doc_ids, steer=(name, strength))
    # The same version as transformers' cache: the last token's values differ.
    cache = kdn.hf._layer_kv(kdn.hf.fetch_document(reference, doc_ids, client,
                                                   steer=(name, strength)))
    np.testing.assert_array_equal(cache[layers[0]][1][0].numpy(), steered[1][layers[0]])
    assert kdn.hf.fetch_document(reference, doc_ids, client, steer=(name, 3)) is None
    np.testing.assert_array_equal(steered[0], original[0])  # keys untouched
    delta = steered[1] - original[1]
    delta_want = np.zeros_like(delta)
    for i, layer in enumerate(layers):
        delta_want[layer, :, -1, :] = strength * values[i]
    np.testing.assert_allclose(delta, delta_want, atol=1e-5)

    pairs_file = tmp_path / "pairs.json"
    pairs_file.write_text(json.dumps(body))
    selection = "boundary+deviation:8"
    f32 = ("--weights-dtype", "f32")
    r = deployment.completion(question, documents=[{"text": doc, "steer": steer}],
                              max_tokens=NEW_TOKENS, temperature=0, blend_selection=selection)
    assert details(r["usage"])["blended_tokens"] == len(doc_ids), r["usage"]
    want, _ = blend_text(smollm2, [doc], question, NEW_TOKENS, selection,
                         extra=f32 + ("--steer", "0=%s" % strength, "--steering-pairs",
                                      pairs_file))
    assert r["choices"][0]["text"] == want
    plain = deployment.completion(question, documents=[doc], max_tokens=NEW_TOKENS,
                                  temperature=0, blend_selection=selection)
    assert plain["choices"][0]["text"] != want, want


def test_another_model_misses_and_a_wrong_layout_is_refused(smollm2, deployment, client):
    ids = llama_cpp_ids(smollm2, [text(1, 14)])[0]  # stored by the first test
    assert client.lookup(ids) > 0
    bf16 = kdn.Model(smollm2, kv_dtype="bf16")
    assert bf16.fingerprint != client.model.fingerprint
    with kdn.Client(client.uri, bf16, curve_keys=str(deployment.run_dir / "curve.key"),
                    chunk_tokens=CHUNK) as other:
        assert other.lookup(ids) == 0
        assert other.fetch(ids)[0] == 0
    # A layout of another shape: refused by libkdn_client, naming both.
    m = client.model
    k = torch.zeros(m.layers - 1, m.kv_heads, 8, m.head_dim)
    with pytest.raises(kdn.KdnError) as e:
        client.fetch_into(ids, list(k), list(k.clone()), "htd", limit=8)
    assert e.value.code == "INVALID_ARGUMENT"
    assert "29 layers" in e.value.message and "30 x 3 x 64" in e.value.message, e.value.message
    short = torch.zeros(m.layers, m.kv_heads, 4, m.head_dim)
    with pytest.raises(kdn.KdnError, match="past the KV buffers"):
        client.fetch_into(ids, list(short), list(short.clone()), "htd", limit=8)


# --- a Redis the test starts: the store whose values can be edited


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """One standalone Redis, started as kdn-launch starts its nodes."""
    c = redis_cluster.start_cluster(tmp_path_factory.mktemp("redis"), 1, standalone=True)
    try:
        yield c
    finally:
        c.stop(quiet=True)


def test_a_changed_chunk_is_a_miss(smollm2, reference, redis):
    model = kdn.Model(smollm2, kv_dtype="f32")
    with kdn.Client(redis.url(), model, chunk_tokens=CHUNK) as c:
        ids = llama_cpp_ids(smollm2, [text(3, 9)])[0]
        kdn.hf.store_cache(reference, ids, full_cache(reference, ids), c)
        _, cached = kdn.hf.fetch_cache(reference, ids, c)
        assert cached == len(ids) - 1
        # One byte of the second chunk's payload, changed in place.
        second = c.spans(ids)[1]
        key = "kdn:%s:%s" % (model.fingerprint, second.key)
        cli = ["redis-cli", "--no-auth-warning", "-a", redis.password, "-p",
               str(redis.nodes[0].port)]
        size = int(subprocess.run(cli + ["strlen", key], capture_output=True, text=True,
                                  check=True).stdout)
        assert size > 128 * 1024, size  # the 128-byte header and 256 tokens of KV
        old = subprocess.run(cli + ["--no-raw", "getrange", key, "4096", "4096"],
                             capture_output=True, text=True, check=True).stdout
        new = "A" if "A" not in old else "B"
        subprocess.run(cli + ["setrange", key, "4096", new], check=True, capture_output=True)
        cache, cached = kdn.hf.fetch_cache(reference, ids, c)
        assert cached == CHUNK  # the first chunk only: a miss from the changed one on
        # What it brought is right: the answer is the full prefill's.
        assert greedy(reference, ids, cache) == greedy(reference, ids)


# ---- The KDN failing under an engine: no failure of it is the engine's.

@pytest.fixture
def shards(tmp_path_factory):
    """A Redis Cluster of 3 primaries and no replicas, started as kdn-launch
    starts one, whose node timeout no test outlasts: a primary killed or
    stopped stays so, and its slots with it."""
    c = redis_cluster.start_cluster(tmp_path_factory.mktemp("redis-shards"), 3,
                                    node_timeout_ms=600000, replicas=0)
    try:
        yield c
    finally:
        c.stop(quiet=True)


def test_a_dead_shard_is_a_miss_and_a_store_on_it_is_dropped_never_an_error(smollm2, reference,
                                                                             shards, caplog):
    caplog.set_level(logging.INFO)
    password_file = redis_cluster.password_path(shards.run_dir)
    password = password_file.read_text().strip()
    model = kdn.Model(smollm2, kv_dtype="f32")
    # The URL has no password: the client reads the file.
    with kdn.Client(shards.worker_url(), model, chunk_tokens=CHUNK,
                    redis_password_file=password_file) as c:
        victim = shards.nodes[0]
        stored, fresh = prompts_on(smollm2, model, c, shards, victim, 2, range(40, 64))
        kdn.hf.store_cache(reference, stored, full_cache(reference, stored), c)
        assert kdn.hf.fetch_cache(reference, stored, c)[1] == len(stored) - 1

        victim.proc.popen.send_signal(signal.SIGKILL)
        victim.proc.popen.wait(timeout=30)
        # A load from the dead shard is a miss; the answer is the model's own.
        cache, cached = kdn.hf.fetch_cache(reference, stored, c)
        assert cached == 0
        assert greedy(reference, stored, cache) == greedy(reference, stored)
        # A store on it stores nothing and says so, twice; no exception.
        cache = full_cache(reference, fresh)
        for _ in range(2):
            r = kdn.hf.store_cache(reference, fresh, cache, c)
            assert r.stored == 0 and r.not_stored > 0, r
        assert sum(n for (call, _), n in c.failures.items() if call == "store") == 2, c.failures
        warned = [r for r in caplog.records if r.name == "kdn" and r.levelno == logging.WARNING]
        assert len(warned) == 1 and "store" in warned[0].getMessage(), [
            r.getMessage() for r in warned]
    assert all(password not in r.getMessage() for r in caplog.records)
    assert no_process_shows(password)


class BlockedClient:
    """A client whose store waits until the test releases it."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()
        self.stored = []

    def store(self, tokens, k, v, dims, failure="raise"):
        self.started.set()
        assert self.release.wait(60)
        self.stored.append(list(tokens))
        return kdn.StoreResult(stored=1)


def test_a_background_store_never_holds_its_caller_and_drops_past_its_bound():
    c = BlockedClient()
    kv = [np.zeros((4, 256), np.float32)]  # 4 KiB: 8 KiB of K and V a put
    stores = kdn.BackgroundStore(c, max_bytes=16 << 10)
    assert stores.put([1], kv, kv, "thd")
    assert c.started.wait(30)
    # The first store is under way and blocked: the puts return all the
    # same, the one past the bound dropped.
    assert stores.put([2], kv, kv, "thd")
    assert not stores.put([3], kv, kv, "thd")
    assert stores.dropped == 1 and c.stored == [] and stores.pending() == 16 << 10
    c.release.set()
    assert stores.flush(timeout=30)
    assert c.stored == [[1], [2]] and stores.pending() == 0
    stores.close()
    assert not stores.put([4], kv, kv, "thd") and stores.dropped == 2


def test_a_stopped_shard_fails_a_background_store_that_then_succeeds_once_it_answers(
        smollm2, reference, shards):
    model = kdn.Model(smollm2, kv_dtype="f32")
    with kdn.Client(shards.worker_url(), model, chunk_tokens=CHUNK,
                    redis_password_file=redis_cluster.password_path(shards.run_dir)) as c:
        slow = shards.nodes[1]
        ids = prompts_on(smollm2, model, c, shards, slow, 1, range(64, 88))[0]
        cache = full_cache(reference, ids)
        ks = [key[0].contiguous() for key, _ in kdn.hf._layer_kv(cache)]
        vs = [value[0].contiguous() for _, value in kdn.hf._layer_kv(cache)]
        stores = kdn.BackgroundStore(c)
        slow.proc.popen.send_signal(signal.SIGSTOP)
        try:
            assert stores.put(ids, ks, vs, "htd")
            # The store thread waits out the client's timeout and gives up.
            assert stores.flush(timeout=120)
            assert c.failures.get(("store", "UNAVAILABLE")) == 1, c.failures
        finally:
            slow.proc.popen.send_signal(signal.SIGCONT)
        assert wait_until(lambda: c.store(ids, ks, vs, "htd", failure="miss").stored > 0, 60)
        assert c.lookup(ids) == sum(s.count for s in c.spans(ids))
        stores.close()
