"""More than one router (docs/serving.md, "More than one router"): `kdn-launch
up --routers 2` starts two routers over the same workers. Each serves any
request, a prefix one router's request left in the KDN is a hit through the
other, and a router killed mid-way leaves the other serving, its stream
included. The prompts are token ids.
"""

import json
import os
import random
import signal
import threading

import httpx

from deploy_util import CHUNK_TOKENS, Deployment, launch, pid_alive, sse_events, wait_until


def test_two_routers_share_the_workers_and_one_outlives_the_other(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("run-routers"), tiny_model, "--store", "--routers", 2)
    other = None
    try:
        urls = d.info["urls"]
        assert len(urls) == 2 and urls[0] == d.url and urls[1] != d.url, urls
        other = httpx.Client(base_url=urls[1], timeout=httpx.Timeout(60.0))

        def via_other(prompt, **fields):
            r = other.post("/v1/completions", json=dict(prompt=prompt, **fields))
            assert r.status_code == 200, r.text[:500]
            return r.json()

        rng = random.Random(20261207)
        a = [rng.randrange(3, 256) for _ in range(2 * CHUNK_TOKENS + 40)]
        first = d.completion(a, max_tokens=4, temperature=0, ignore_eos=True,
                             disaggregation="always")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first["usage"]
        # The same prefix through the other router is a hit: the workers and
        # the KDN are the deployment's, not a router's.
        b = a[:2 * CHUNK_TOKENS] + [rng.randrange(3, 256) for _ in range(30)]
        second = via_other(b, max_tokens=4, temperature=0, ignore_eos=True,
                           disaggregation="always")
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * CHUNK_TOKENS, \
            second["usage"]

        # A stream through the second router while the first is killed.
        chunks, done = [], threading.Event()

        def stream():
            body = dict(prompt=a, max_tokens=1400, temperature=0, ignore_eos=True, stream=True)
            with other.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    chunks.append(line)
            done.set()

        t = threading.Thread(target=stream)
        t.start()
        assert wait_until(lambda: len(chunks) > 3, timeout=60, step=0.002), \
            "the stream never started"
        router = d.pid("router")
        os.kill(router, signal.SIGKILL)
        assert not done.is_set(), "the stream ended before the first router was killed"
        assert wait_until(lambda: not pid_alive(router), timeout=30)
        t.join(timeout=120)
        assert done.is_set(), "the stream through the second router did not end"
        events = sse_events(chunks)
        assert events[-1] == "[DONE]", events[-3:]
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]
                       if json.loads(e)["choices"])
        finish = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1]
                  if json.loads(e)["choices"]]
        assert finish[-1] == "length", finish[-3:]
        assert text, "no text streamed"
        # New requests go on through the survivor.
        again = via_other(b, max_tokens=2, temperature=0, ignore_eos=True,
                          disaggregation="always")
        assert again["usage"]["completion_tokens"] == 2
        # `status` names the dead router and fails.
        st = launch("status", "--run-dir", d.run_dir)
        assert st.returncode == 1, st.stdout
        assert any(line.split()[:2] == ["router", "router"] and "dead" in line.split()
                   for line in st.stdout.splitlines()), st.stdout
    finally:
        if other is not None:
            other.close()
        d.down()
