"""Deployments whose KDN is a Redis Cluster (docs/kvbus.md, "Redis tier"):
`kdn-launch up --redis-cluster 3` serves chats and documents as a kdn-store
deployment does, a second deployment pointed at the same cluster
(`--kdn-redis URL --kdn-redis-password-file FILE`) finds the first one's
prefixes, no command line holding the password,, and a primary killed in
the middle of a chat costs cache hits, never a request.

Waits are exact: a test that needs chunks in the cluster polls Redis for
their keys (computed by kdn_keys from docs/kvbus.md's definitions).
"""

import os
import random
import signal
import subprocess
from pathlib import Path

import pytest

from deploy_util import CHUNK_TOKENS, BIN_DIR, Deployment, generate_ids, wait_until
from test_blend import fresh_docs, inject

ANSWER_TOKENS = 8
FIRST_TOKENS = 300  # a full chunk and a tail of 44
TURN_TOKENS = 40


@pytest.fixture(scope="module")
def redis_deployment(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-redis"), tiny_model, "--redis-cluster", 3,
                   "--redis-maxmemory-mib", 256)
    try:
        yield d
    finally:
        d.down()


class Cluster:
    """The deployment's Redis nodes, asked with redis-cli (the password in
    $REDISCLI_AUTH, never on a command line)."""

    def __init__(self, d):
        self.password = (d.run_dir / "redis.password").read_text().strip()
        self.nodes = [p for p in d.info["processes"] if p["role"] == "redis"]
        self.endpoints = [p["endpoint"][len("redis://"):] for p in self.nodes]

    def url(self, with_password=True):
        cred = ":%s@" % self.password if with_password else ""
        return "redis://%s%s" % (cred, ",".join(self.endpoints))

    def cli(self, endpoint, *args):
        host, port = endpoint.rsplit(":", 1)
        r = subprocess.run(["redis-cli", "-c", "-h", host, "-p", port, *args],
                           capture_output=True, text=True, timeout=10,
                           env=dict(os.environ, REDISCLI_AUTH=self.password))
        return r.stdout.strip()

    def live(self):
        return [e for n, e in zip(self.nodes, self.endpoints) if _alive(n["pid"])]

    def primaries(self):
        return [(n, e) for n, e in zip(self.nodes, self.endpoints)
                if _alive(n["pid"]) and self.cli(e, "role").startswith("master")]

    def fingerprint(self):
        """The model fingerprint in the deployment's keys (kdn:<fp>:<key>)."""
        for e in self.live():
            for key in self.cli(e, "--scan", "--pattern", "kdn:*").split():
                return key.split(":")[1]
        return None

    def holds(self, fingerprint, keys):
        e = self.live()[0]
        return all(self.cli(e, "exists", "kdn:%s:%s" % (fingerprint, k)) == "1" for k in keys)


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def stored_keys(fingerprint, ids):
    """The chunk keys a worker stores for `ids`: its full chunks' prefix
    keys and its tail pieces' keys."""
    def keys_tool(kind):
        r = subprocess.run([str(BIN_DIR / "kdn_keys"), kind, fingerprint, "", str(CHUNK_TOKENS),
                            "-"], input=",".join(map(str, ids)), capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.split("\n")
    prefix = [line for line in keys_tool("prefix") if line]
    tail = [line.split()[2] for line in keys_tool("tail") if line]
    return prefix + tail


def wait_stored(cluster, ids_list):
    """Until the cluster holds every chunk of each token list in `ids_list`."""
    assert wait_until(lambda: cluster.fingerprint() is not None, 30), "no kdn key in the cluster"
    fp = cluster.fingerprint()
    keys = [k for ids in ids_list for k in stored_keys(fp, ids)]
    assert wait_until(lambda: cluster.holds(fp, keys), 30), "the cluster lacks some of %s" % keys


def answer_ids(model, ids):
    return [int(t) for t in generate_ids(model, ids, ANSWER_TOKENS, "--print-ids").split(b",")]


def chat_turns(d, rng, turns, cluster=None, between=None):
    """A conversation of token ids, `turns` turns through the prefill worker:
    each answer must be kdn-generate's. With `cluster`, each turn first waits
    until the last one's conversation is stored, and its cached_tokens must
    be all of it (the last answer token is never run through the model).
    `between(turn)` runs before each turn."""
    ids = [rng.randrange(3, 256) for _ in range(FIRST_TOKENS)]
    stored, cached = 0, []
    for turn in range(turns):
        if between is not None:
            between(turn)
        r = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                         disaggregation="always")
        want = generate_ids(d.model, ids, ANSWER_TOKENS).decode("utf-8", errors="replace")
        assert r["choices"][0]["text"] == want, "turn %d differs from kdn-generate" % turn
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        if cluster is not None:
            assert cached[-1] == stored, (turn, r["usage"])
        answer = answer_ids(d.model, ids)
        conversation = ids + answer[:-1]
        if cluster is not None:
            wait_stored(cluster, [ids, conversation])
        stored = len(conversation)
        ids = ids + answer + [rng.randrange(3, 256) for _ in range(TURN_TOKENS)]
    return cached


def test_chats_and_documents_as_with_kdn_store(redis_deployment, store_deployment):
    d = redis_deployment
    cluster = Cluster(d)
    # The workers read the password from its file: no command line shows it.
    for name in ("prefill-0", "decode-0"):
        cmdline = Path("/proc/%d/cmdline" % d.pid(name)).read_bytes().decode(errors="replace")
        assert "--kdn-redis-password-file" in cmdline and cluster.password not in cmdline
    # Later turns load the whole conversation from the cluster.
    chat_turns(d, random.Random(20261127), 3, cluster)
    # Documents: injected (stored before the reply), then blended, the same
    # answer and cached tokens as through kdn-store.
    docs = fresh_docs(3, 200)
    question = "Question: which word comes first?\nAnswer:"
    got = []
    for dep in (store_deployment, d):
        final, _ = inject(dep, docs)
        assert (final["stored"], final["failed"]) == (3, 0), final
        r = dep.completion(question, documents=docs[::-1], max_tokens=6, temperature=0)
        got.append((r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]))
    assert got[0] == got[1]
    assert got[1][1]["cached_tokens"] > 0, got


def test_a_second_deployment_finds_the_first_ones_prefixes(redis_deployment, tiny_model,
                                                           tmp_path_factory):
    d = redis_deployment
    cluster = Cluster(d)
    rng = random.Random(7)
    ids = [rng.randrange(3, 256) for _ in range(FIRST_TOKENS)]
    first = d.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    wait_stored(cluster, [ids])
    # The password in a file, as the first deployment's workers take it.
    other = Deployment(tmp_path_factory.mktemp("run-redis-2"), tiny_model,
                       "--kdn-redis", cluster.url(with_password=False),
                       "--kdn-redis-password-file", d.run_dir / "redis.password")
    try:
        for name in ("prefill-0", "decode-0"):
            cmdline = Path("/proc/%d/cmdline" % other.pid(name)).read_bytes().decode(
                errors="replace")
            assert cluster.password not in cmdline, name
        r = other.completion(ids, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True,
                             disaggregation="always")
        assert r["choices"][0]["text"] == first["choices"][0]["text"]
        # Its workers never saw this prompt: the full chunk and the tail
        # pieces past it came from the first deployment, through Redis.
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= CHUNK_TOKENS, r["usage"]
    finally:
        other.down()


def test_a_primary_killed_mid_chat_costs_hits_not_requests(redis_deployment):
    d = redis_deployment
    cluster = Cluster(d)
    primaries = cluster.primaries()
    assert len(primaries) == 3, primaries
    victim = primaries[0][0]

    def kill_after_first(turn):
        if turn == 1:
            os.kill(victim["pid"], signal.SIGKILL)

    # Every turn answers, kdn-generate's answer, before, during and after
    # the failover (chat_turns asserts both for each).
    chat_turns(d, random.Random(99), 4, between=kill_after_first)
    # Its replica took over: three primaries again.
    assert wait_until(lambda: len(cluster.primaries()) == 3, 60), cluster.primaries()
    chat_turns(d, random.Random(100), 2)
