"""Pinning a prompt prefix with a TTL (docs/serving.md, "Pinning a prefix"): a
deployment of the tiny model whose workers' host tiers hold 8 chunks, with
two tenants. A prefix pinned with `cache_control` outlives a flood of other
prompts that evicts everything else, for its TTL, in the host tiers and in
the prefill worker's KV pool; one whose TTL has run out
or that was dropped with DELETE /v1/kdn/pins/ID goes with the flood. A
tenant sees and drops only its own pins; a pin past the tenant's bound is
a 429, a bad `cache_control` a 400 naming the field. The prompts are token
ids; the chat form goes through the official openai client.
"""

import random
import time

import httpx
import openai

from deploy_util import CHUNK_TOKENS, Deployment, metric, parse_metrics, settled_metrics

KEYS = {"alice-key-0123456789": "alice", "bob-key-9876543210abc": "bob"}
ALICE, BOB = list(KEYS)


def cached(usage):
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_pins_outlive_eviction_for_their_ttl_per_tenant(tiny_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("run-pins")
    keys = run / "api-keys"
    keys.write_text("".join("%s %s\n" % kv for kv in KEYS.items()))
    # Host tiers of 1 MiB: 8 chunks of the tiny model's f32 KV (256 tokens x
    # 512 bytes); pools of 4096 tokens at the decode worker. The pin bound,
    # 1 MiB a tenant, holds two pins of 3 chunks (counted as f32: 384 KiB).
    d = Deployment(run, tiny_model, "--api-keys", keys, "--host-mib", 1,
                   "--decode-kv-tokens", 4096, "--max-pinned-mib", 1,
                   "--disaggregation", "always", api_key=ALICE)
    bob = httpx.Client(base_url=d.url, timeout=httpx.Timeout(60.0),
                       headers={"Authorization": "Bearer " + BOB})
    try:
        rng = random.Random(20261207)

        def prompt(n):
            return [rng.randrange(3, 256) for _ in range(n)]

        def ask(prefix, **fields):
            return d.completion(prefix + prompt(40), max_tokens=2, temperature=0,
                                ignore_eos=True, **fields)["usage"]

        def flood():
            # 24 prompts of 1,800 tokens: 144 chunks through 8-chunk host
            # tiers, 43,200 tokens through the pools (prefill's 16,384,
            # decode's 4,096).
            for _ in range(24):
                ask(prompt(1800))

        pinned, short, plain = prompt(3 * CHUNK_TOKENS), prompt(3 * CHUNK_TOKENS), \
            prompt(3 * CHUNK_TOKENS)
        u = ask(pinned, cache_control={"type": "ephemeral", "ttl": "10m"})
        assert u["prompt_tokens_details"]["pinned_tokens"] == 3 * CHUNK_TOKENS, u
        expires = u["prompt_tokens_details"]["pin_expires_at"]
        assert 590 <= expires - time.time() <= 610, u
        u = ask(short, cache_control={"type": "ephemeral", "ttl": "2s"})
        short_pinned_at = time.monotonic()
        assert u["prompt_tokens_details"]["pinned_tokens"] == 3 * CHUNK_TOKENS, u
        ask(plain)

        pins = d.http.get("/v1/kdn/pins").json()["data"]
        assert sorted(p["ttl_seconds"] for p in pins) == [2, 600], pins
        assert all(p["tokens"] == 3 * CHUNK_TOKENS and p["bytes"] == 3 * CHUNK_TOKENS * 512
                   for p in pins), pins
        # Bob sees none of Alice's pins and cannot drop them.
        assert bob.get("/v1/kdn/pins").json()["data"] == []
        long_id = next(p["id"] for p in pins if p["ttl_seconds"] == 600)
        r = bob.delete("/v1/kdn/pins/" + long_id)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "pin_not_found"

        # The short pin's TTL runs out; the flood then evicts it and the
        # unpinned prefix, never the pinned one.
        time.sleep(max(0.0, 2.5 - (time.monotonic() - short_pinned_at)))
        assert [p["ttl_seconds"] for p in d.http.get("/v1/kdn/pins").json()["data"]] == [600]
        flood()
        before = settled_metrics(d)
        u = ask(pinned)
        after = settled_metrics(d)
        assert cached(u) >= 3 * CHUNK_TOKENS, u
        # The prefill worker's pool kept it too: attached where it lies,
        # with no KV copied in from the host tier.
        def prefill_delta(name):
            return (metric(after, name, worker="prefill-0", role="prefill")
                    - metric(before, name, worker="prefill-0", role="prefill"))
        assert metric(before, "kdn_worker_resident_pinned_kv_blocks", worker="prefill-0",
                      role="prefill") == 3 * CHUNK_TOKENS // 16
        assert prefill_delta("kdn_worker_resident_hit_tokens_total") >= 3 * CHUNK_TOKENS
        assert prefill_delta("kdn_worker_kv_loaded_bytes_total") == 0
        assert u["prompt_tokens_details"]["pinned_tokens"] == 3 * CHUNK_TOKENS, u
        assert cached(ask(short)) == 0
        assert cached(ask(plain)) == 0
        hits = [p["hits"] for p in d.http.get("/v1/kdn/pins").json()["data"]]
        assert hits == [1], hits

        # A third pin would take Alice past her 1 MiB; Bob has his own bound.
        body = dict(prompt=prompt(3 * CHUNK_TOKENS + 40), max_tokens=2,
                    cache_control={"type": "ephemeral"})
        assert d.http.post("/v1/completions", json=body).status_code == 200
        r = d.http.post("/v1/completions", json=dict(body, prompt=prompt(3 * CHUNK_TOKENS + 40)))
        assert r.status_code == 429, r.text
        assert "past its bound" in r.json()["error"]["message"], r.text
        assert bob.post("/v1/completions", json=body).status_code == 200

        # A bad cache_control is a 400 naming the field.
        r = d.http.post("/v1/chat/completions", json=dict(
            messages=[{"role": "system", "content": "s",
                       "cache_control": {"type": "ephemeral", "ttl": "5d"}},
                      {"role": "user", "content": "u"}]))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].cache_control.ttl", r.text

        # The chat form, as Anthropic's clients send it: on a content part.
        system = "You answer in one word. " * 25  # 600 bytes: two whole chunks
        client = openai.OpenAI(base_url=d.url + "/v1", api_key=ALICE, max_retries=0,
                               timeout=60.0)
        out = client.chat.completions.create(
            model=d.model_name, max_tokens=2,
            messages=[{"role": "system",
                       "content": [{"type": "text", "text": system,
                                    "cache_control": {"type": "ephemeral", "ttl": "5m"}}]},
                      {"role": "user", "content": "Hello?"}])
        details = out.usage.prompt_tokens_details.model_extra
        assert details["pinned_tokens"] > 0 and details["pinned_tokens"] % CHUNK_TOKENS == 0, \
            details

        # Dropped, the long pin goes with the next flood.
        r = d.http.delete("/v1/kdn/pins/" + long_id)
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert long_id not in [p["id"] for p in d.http.get("/v1/kdn/pins").json()["data"]]
        flood()
        assert cached(ask(pinned)) == 0

        samples = parse_metrics(d.metrics())
        assert metric(samples, "kdn_pins_refused_total") == 1
        assert metric(samples, "kdn_pin_hits_total") >= 1
        assert metric(samples, "kdn_pins") == 3  # Alice's two, Bob's one
        # One route label for every pin's path (Bob's DELETE of Alice's pin: a 404).
        assert metric(samples, "kdn_requests_total", route="/v1/kdn/pins", code="404") == 1
        assert not [labels for _, labels in samples
                    if dict(labels).get("route", "").startswith("/v1/kdn/pins/")], samples
        # DELETE without an id drops every pin of the tenant.
        assert d.http.delete("/v1/kdn/pins").status_code == 200
        assert d.http.get("/v1/kdn/pins").json()["data"] == []
        assert len(bob.get("/v1/kdn/pins").json()["data"]) == 1
    finally:
        bob.close()
        d.down()
