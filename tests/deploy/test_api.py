"""The HTTP API of a 1 prefill + 1 decode deployment of the tiny model
(docs/serving.md): greedy tokens equal the engine alone, prefix caching and
its usage and metrics figures, the official OpenAI client, curl, bad requests
and /metrics.
"""

import json
import os
import random
import re
import shutil
import subprocess
import uuid

import openai
import pytest

from deploy_util import (CHUNK_TOKENS, REPO, TINY_CONTEXT, binary, metric, metric_types,
                         parse_metrics, repeat_cached, sse_events, wait_until)

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def words_text(rng, n_chars):
    """ASCII text of exactly n_chars characters (so n_chars tokens on tiny)."""
    out = []
    while len(" ".join(out)) < n_chars:
        out.append(rng.choice(WORDS))
    text = " ".join(out)[:n_chars]
    assert len(text) == n_chars
    return text


# Greedy prompts. The tiny random model mostly repeats a character; "A" and
# "Z" switch to another one after a dozen tokens, which depends on positions
# and on the KV of the earlier tokens. The long one spans two full chunks, so
# its second request loads them from the KDN.
LONG_PROMPT = words_text(random.Random(20240611), 600)
GREEDY_PROMPTS = {"hello": "Hello world", "A": "A", "Z": "Z", "long": LONG_PROMPT}


def engine_text(model, prompt, max_tokens):
    """The continuation kdn-generate prints (greedy by default)."""
    r = subprocess.run([binary("kdn-generate"), "--model", str(model), "--prompt", prompt,
                        "--max-tokens", str(max_tokens), "--threads", "1"],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    out = r.stdout
    assert out.endswith(b"\n"), out
    return out[:-1].decode("utf-8")


def cached_tokens(usage):
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def check_usage(usage, prompt_tokens, max_tokens):
    assert isinstance(usage, dict), usage
    assert usage["prompt_tokens"] == prompt_tokens, usage
    assert 1 <= usage["completion_tokens"] <= max_tokens, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert isinstance(cached_tokens(usage), int), usage


# ------------------------------------------------------------ greedy tokens


@pytest.mark.parametrize("key", list(GREEDY_PROMPTS))
def test_greedy_completion_equals_engine_alone(deployment, key):
    prompt = GREEDY_PROMPTS[key]
    want = engine_text(deployment.model, prompt, 24)
    # Both on the prefill worker's path, whose KDN lookup repeat_cached
    # models: under `auto` the repeat could go to the decode worker while
    # the router still counts the first prompt's tokens against the prefill
    # worker (until its next report), and the decode worker's own resident
    # conversation ends its tail pieces elsewhere (577 cached, not 593).
    path = {"disaggregation": "always"}
    first = deployment.completion(prompt, max_tokens=24, temperature=0, **path)
    assert first["object"] == "text_completion"
    assert first["choices"][0]["text"] == want, "served text differs from kdn-generate's"
    check_usage(first["usage"], len(prompt) + 1, 24)
    # The same request again: a cache hit must not change the answer.
    second = deployment.completion(prompt, max_tokens=24, temperature=0, **path)
    assert second["choices"][0]["text"] == want, "the repeated request's text changed"
    if key == "long":
        assert cached_tokens(first["usage"]) == 0
        # Its full chunks and, past them, the tail pieces it stored.
        assert cached_tokens(second["usage"]) == repeat_cached(len(prompt) + 1, 24)


def test_chat_completion_is_well_formed(deployment):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello."}]
    for _ in range(2):  # the second one is a repeat
        r = deployment.chat(messages, max_tokens=12, temperature=0)
        assert r["object"] == "chat.completion"
        assert isinstance(r["id"], str) and r["id"]
        assert r["model"] == deployment.model_name
        choice = r["choices"][0]
        assert choice["index"] == 0
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
        usage = r["usage"]
        assert usage["prompt_tokens"] > len("You are terse.Say hello."), usage
        assert 1 <= usage["completion_tokens"] <= 12
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_output_that_is_not_utf8_still_completes(deployment):
    """Byte-level tokens need not form UTF-8: the tiny model answers the
    token-id prompt "Hi" + 0xC7 with 0xC7 bytes (a lead byte with no
    continuation). The request must still finish, streamed or not."""
    prompt = [72, 105, 199]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = deployment.http.post("/v1/completions", json=body, timeout=15.0)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] == 8, r.json()
    with deployment.http.stream("POST", "/v1/completions", json=dict(body, stream=True),
                                timeout=15.0) as s:
        assert s.status_code == 200
        events = sse_events(s.iter_lines())
    assert events and events[-1] == "[DONE]", events[-3:]


# ---------------------------------------------------------- the first token
# The router sends the prefill worker's first token to the client at once
# (docs/design.md, step 5); the decode worker goes on from the second.


def decode_worker_idle(deployment):
    """The decode worker's (queue depth, free KV blocks) once it runs nothing."""
    def idle():
        s = parse_metrics(deployment.metrics())
        depth = metric(s, "kdn_worker_queue_depth", worker="decode-0", role="decode")
        return (depth, metric(s, "kdn_worker_free_kv_blocks", worker="decode-0",
                              role="decode")) if depth == 0 else None
    got = wait_until(idle, 10)
    assert got, "the decode worker still runs a request:\n%s" % deployment.log_tails()
    return got


def test_a_first_token_that_ends_the_request_needs_no_decode_step(deployment):
    """max_tokens=1 ends at the prefill worker's token: the engine's token,
    counted once, streamed or not, and the decode worker gives back the KV it
    reserved for the request."""
    idle_before = decode_worker_idle(deployment)
    before = parse_metrics(deployment.metrics())
    want = engine_text(deployment.model, "Hello world", 1)
    r = deployment.completion("Hello world", max_tokens=1, temperature=0)
    assert r["choices"][0]["text"] == want
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 1, r["usage"]
    body = {"prompt": "Hello world", "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with deployment.http.stream("POST", "/v1/completions", json=body, timeout=30.0) as s:
        assert s.status_code == 200
        events = sse_events(s.iter_lines())
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == want
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]
            if ch.get("finish_reason")] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 1
    after = parse_metrics(deployment.metrics())
    for name in ("kdn_ttft_seconds_count", "kdn_generated_tokens_total"):
        assert metric(after, name) - metric(before, name) == 2, name
    assert decode_worker_idle(deployment) == idle_before


def test_each_token_is_counted_once(deployment):
    """The first token comes from the router, the rest from the decode
    worker: usage and the token metrics count each token once."""
    decode_worker_idle(deployment)
    before = parse_metrics(deployment.metrics())
    want = engine_text(deployment.model, "Z", 16)
    body = {"prompt": "Z", "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with deployment.http.stream("POST", "/v1/completions", json=body, timeout=30.0) as s:
        assert s.status_code == 200
        events = sse_events(s.iter_lines())
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == want
    n = chunks[-1]["usage"]["completion_tokens"]
    assert n >= 2, "precondition: the decode worker generates tokens (got %d)" % n
    after = parse_metrics(deployment.metrics())
    grew = {name: metric(after, name) - metric(before, name)
            for name in ("kdn_ttft_seconds_count", "kdn_inter_token_seconds_count",
                         "kdn_generated_tokens_total")}
    assert grew == {"kdn_ttft_seconds_count": 1, "kdn_inter_token_seconds_count": n - 1,
                    "kdn_generated_tokens_total": n}, grew


# ----------------------------------------------------------- prefix caching


def test_prefix_cache_hit_counts_cached_tokens(deployment):
    rng = random.Random(uuid.uuid4().int)  # text no earlier request used
    shared = words_text(rng, 1000)
    a = shared + " then suffix A: " + words_text(rng, 40)
    b = shared + " and a different suffix B"
    before = parse_metrics(deployment.metrics())

    ra = deployment.completion(a, max_tokens=4, temperature=0)
    check_usage(ra["usage"], len(a) + 1, 4)
    assert cached_tokens(ra["usage"]) == 0, "a fresh text found cached tokens"
    computed_a = metric(before, "kdn_prompt_tokens_total", source="computed") + len(a) + 1

    def computed_is(want):
        got = metric(parse_metrics(deployment.metrics()), "kdn_prompt_tokens_total", source="computed")
        return got == want

    assert wait_until(lambda: computed_is(computed_a), 3), \
        "kdn_prompt_tokens_total{source=computed} did not grow by A's %d prompt tokens" % (len(a) + 1)
    mid = parse_metrics(deployment.metrics())

    rb = deployment.completion(b, max_tokens=4, temperature=0)
    check_usage(rb["usage"], len(b) + 1, 4)
    want_cached = CHUNK_TOKENS * ((1000 + 1) // CHUNK_TOKENS)  # the BOS is a prompt token
    assert cached_tokens(rb["usage"]) == want_cached, rb["usage"]
    want_computed = rb["usage"]["prompt_tokens"] - want_cached
    computed_b = metric(mid, "kdn_prompt_tokens_total", source="computed") + want_computed
    assert wait_until(lambda: computed_is(computed_b), 3), (
        "kdn_prompt_tokens_total{source=computed} grew by %s for B, want %d" % (
            metric(parse_metrics(deployment.metrics()), "kdn_prompt_tokens_total", source="computed")
            - metric(mid, "kdn_prompt_tokens_total", source="computed"), want_computed))
    after = parse_metrics(deployment.metrics())
    assert (metric(after, "kdn_prompt_tokens_total", source="cached")
            - metric(mid, "kdn_prompt_tokens_total", source="cached")) == want_cached


def test_cache_salt_separates_tenants(deployment):
    rng = random.Random(uuid.uuid4().int)
    text = words_text(rng, 600)
    first = deployment.completion(text, max_tokens=2, temperature=0, cache_salt="tenant-a")
    assert cached_tokens(first["usage"]) == 0
    other = deployment.completion(text, max_tokens=2, temperature=0, cache_salt="tenant-b")
    assert cached_tokens(other["usage"]) == 0, "a different cache_salt shared cached KV"
    same = deployment.completion(text, max_tokens=2, temperature=0, cache_salt="tenant-a")
    assert cached_tokens(same["usage"]) == repeat_cached(601, 2), same["usage"]


# -------------------------------------------------------------- openai client


@pytest.fixture(scope="module")
def client(deployment):
    c = openai.OpenAI(base_url=deployment.url + "/v1", api_key="x", max_retries=0, timeout=60.0)
    yield c
    c.close()


def test_openai_models_list(client, deployment):
    ids = [m.id for m in client.models.list()]
    assert ids == [deployment.model_name]


def test_openai_completions_stream_equals_non_stream(client, deployment):
    prompt = "Hello world"
    r = client.completions.create(model=deployment.model_name, prompt=prompt, max_tokens=16,
                                  temperature=0)
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(prompt) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    parts, usage = [], None
    stream = client.completions.create(model=deployment.model_name, prompt=prompt, max_tokens=16,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        assert chunk.object == "text_completion"
        parts.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(parts) == r.choices[0].text
    assert usage is not None, "no usage chunk with stream_options.include_usage"
    assert usage.prompt_tokens == r.usage.prompt_tokens
    assert usage.completion_tokens == r.usage.completion_tokens


def test_openai_chat_stream_equals_non_stream(client, deployment):
    messages = [{"role": "user", "content": "Tell me about caches."}]
    r = client.chat.completions.create(model=deployment.model_name, messages=messages,
                                       max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    parts, usage, roles = [], None, []
    stream = client.chat.completions.create(model=deployment.model_name, messages=messages,
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
        usage = chunk.usage or usage
    assert roles == ["assistant"], roles
    assert "".join(parts) == r.choices[0].message.content
    assert usage is not None, "no usage chunk with stream_options.include_usage"
    assert usage.prompt_tokens == r.usage.prompt_tokens
    assert usage.completion_tokens == r.usage.completion_tokens


# ----------------------------------------------------------------------- curl


def curl(url, body, tmp_path):
    headers = tmp_path / "headers.txt"
    r = subprocess.run(["curl", "-sN", "--max-time", "60", "-D", str(headers), "-H",
                        "Content-Type: application/json", "-d", json.dumps(body), url],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, "curl exit code %d: %s" % (r.returncode, r.stderr)
    head = headers.read_text().lower()
    return head, r.stdout


def test_curl_streaming_and_not(deployment, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    url = deployment.url + "/v1/completions"
    body = {"prompt": "Z", "max_tokens": 20, "temperature": 0}
    head, out = curl(url, body, tmp_path)
    assert head.startswith("http/1.1 200"), head
    plain = json.loads(out)["choices"][0]["text"]

    head, out = curl(url, dict(body, stream=True, stream_options={"include_usage": True}), tmp_path)
    assert head.startswith("http/1.1 200"), head
    assert "content-type: text/event-stream" in head, head
    events = sse_events(out.splitlines())
    assert events and events[-1] == "[DONE]", out[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == plain
    assert chunks[-1]["usage"]["completion_tokens"] == 20


# --------------------------------------------------------------- bad requests

BAD_REQUESTS = [
    # (id, method, path, body: dict or raw bytes, expected status)
    ("malformed-json", "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400),
    ("max-tokens-string", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("max-tokens-negative", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("max-tokens-zero", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("temperature-string", "POST", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("no-prompt", "POST", "/v1/completions", {"max_tokens": 4}, 400),
    ("messages-not-list", "POST", "/v1/chat/completions", {"messages": "hello"}, 400),
    ("prompt-beyond-context", "POST", "/v1/completions", {"prompt": "x" * 3000}, 400),
    ("prompt-plus-max-tokens-beyond-context", "POST", "/v1/completions",
     {"prompt": "x" * (TINY_CONTEXT - 48), "max_tokens": 100}, 400),
    ("n-2", "POST", "/v1/completions", {"prompt": "hi", "n": 2}, 400),
    ("logprobs", "POST", "/v1/completions", {"prompt": "hi", "logprobs": 1}, 400),
    ("unknown-model", "POST", "/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("unknown-path", "GET", "/v1/nope", None, 404),
    ("wrong-method", "GET", "/v1/completions", None, 405),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_openai_error(deployment, case):
    _, method, path, body, want = case
    if isinstance(body, bytes):
        r = deployment.http.request(method, path, content=body,
                                    headers={"Content-Type": "application/json"})
    elif body is not None:
        r = deployment.http.request(method, path, json=body)
    else:
        r = deployment.http.request(method, path)
    assert r.status_code == want, "%s %s %r -> %d %s" % (method, path, body if not isinstance(
        body, dict) else json.dumps(body)[:100], r.status_code, r.text[:300])
    error = r.json().get("error")
    assert isinstance(error, dict), r.text[:300]
    assert isinstance(error.get("message"), str) and error["message"], r.text[:300]
    assert {"message", "type", "param", "code"} <= set(error), r.text[:300]


def test_serves_after_bad_requests(deployment):
    r = deployment.completion("Hello world", max_tokens=8, temperature=0)
    assert r["choices"][0]["text"] == engine_text(deployment.model, "Hello world", 8)
    h = deployment.http.get("/health")
    assert h.status_code == 200, h.text
    assert h.json()["status"] == "ok"


# -------------------------------------------------------------------- metrics

METRICS = {
    "kdn_requests_total": "counter",
    "kdn_requests_in_flight": "gauge",
    "kdn_ttft_seconds": "histogram",
    "kdn_inter_token_seconds": "histogram",
    "kdn_prompt_tokens_total": "counter",
    "kdn_generated_tokens_total": "counter",
    "kdn_kv_bytes_moved_total": "counter",
    "kdn_kv_chunks_skipped_total": "counter",
    "kdn_kv_slices_sourced_total": "counter",
    "kdn_worker_kv_transport_info": "gauge",
    "kdn_worker_up": "gauge",
    "kdn_worker_queue_depth": "gauge",
    "kdn_worker_free_kv_blocks": "gauge",
    "kdn_requests_routed_total": "counter",
    "kdn_worker_local_prefills_total": "counter",
    "kdn_worker_local_prefill_tokens_total": "counter",
    "kdn_worker_local_prefill_backlog_tokens": "gauge",
    "kdn_worker_decode_step_seconds": "gauge",
    "kdn_worker_local_prefill_seconds_per_token": "gauge",
}


def test_metrics_names_types_and_values(deployment):
    # The prefill worker's path, so that KV moves.
    deployment.completion("Hello world", max_tokens=8, temperature=0, disaggregation="always")
    text = deployment.metrics()
    types = metric_types(text)
    for name, kind in METRICS.items():
        assert types.get(name) == kind, "# TYPE %s %s is missing (got %s)" % (name, kind, types.get(name))
    s = parse_metrics(text)
    for worker, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert metric(s, "kdn_worker_up", worker=worker, role=role) == 1, worker
        assert (("kdn_worker_free_kv_blocks", frozenset({"worker": worker, "role": role}.items()))
                in s), "no kdn_worker_free_kv_blocks for %s" % worker
    ok_completions = [v for (name, labels), v in s.items() if name == "kdn_requests_total"
                      and dict(labels).get("code") == "200"
                      and "completions" in dict(labels).get("route", "")]
    assert ok_completions and sum(ok_completions) >= 1, "no kdn_requests_total{route,code=200}"
    assert s.get(("kdn_ttft_seconds_count", frozenset())) >= 1
    assert s.get(("kdn_inter_token_seconds_count", frozenset())) >= 1
    assert s.get(("kdn_generated_tokens_total", frozenset())) >= 8
    assert s.get(("kdn_kv_bytes_moved_total", frozenset())) > 0


def test_metrics_pass_promtool(deployment):
    promtool = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists(
        "/usr/bin/promtool") else None)
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    text = deployment.metrics()
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, "promtool check metrics:\n%s%s" % (r.stdout, r.stderr)


def test_grafana_dashboard_names_only_what_the_deployment_serves(deployment):
    """launch/grafana/kdn.json: every metric a panel queries is a family on
    the router's /metrics page (histograms through _bucket), and every label
    it groups by, filters on or shows in a legend is one those metrics carry."""
    dash = json.loads((REPO / "launch" / "grafana" / "kdn.json").read_text())
    assert dash["panels"], "no panels"
    text = deployment.metrics()
    types = metric_types(text)
    labels = {}  # family -> label names its samples carry
    for (name, pairs) in parse_metrics(text):
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        labels.setdefault(family, set()).update(k for k, _ in pairs)
    for p in dash["panels"]:
        assert p["title"] and p["targets"], p
        for t in p["targets"]:
            expr = t["expr"]
            names = re.findall(r"\b(kdn_[a-z0-9_]+)", expr)
            assert names, expr
            carried = {"le"}
            for n in names:
                family = n
                if n not in types:
                    family = re.sub(r"_(bucket|sum|count)$", "", n)
                    assert types.get(family) == "histogram", "%s (%s) is not on /metrics" % (
                        n, p["title"])
                carried |= labels.get(family, set())
            used = set()
            for group in re.findall(r"by \(([^)]*)\)", expr):
                used |= {g.strip() for g in group.split(",")}
            used |= set(re.findall(r"([a-z_]+)=~?\"", expr))
            used |= set(re.findall(r"\{\{([a-z_]+)\}\}", t.get("legendFormat", "")))
            assert used <= carried, "%s: labels %s not on %s" % (p["title"], used - carried,
                                                                 names)


def test_decode_worker_skips_chunks_it_holds(deployment):
    """The second turn lands on the decode worker that holds the first turn's
    chunks: the prefill worker sends none of their layers again."""
    rng = random.Random(uuid.uuid4().int)
    text = words_text(rng, 2 * CHUNK_TOKENS + 50)
    # The prefill worker's path: KV moves, and what the decode worker holds is skipped.
    deployment.completion(text, max_tokens=2, temperature=0, disaggregation="always")
    before = parse_metrics(deployment.metrics())
    r = deployment.completion(text, max_tokens=2, temperature=0, disaggregation="always")
    assert cached_tokens(r["usage"]) == repeat_cached(2 * CHUNK_TOKENS + 51, 2)
    layers = json.loads((deployment.model / "config.json").read_text())["num_hidden_layers"]

    def skipped():
        return (metric(parse_metrics(deployment.metrics()), "kdn_kv_chunks_skipped_total")
                - metric(before, "kdn_kv_chunks_skipped_total"))

    assert wait_until(lambda: skipped() == 2 * layers, 3), \
        "kdn_kv_chunks_skipped_total grew by %s, want %d (2 chunks x %d layers)" % (
            skipped(), 2 * layers, layers)
