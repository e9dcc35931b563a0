"""API keys and tenants (docs/serving.md, "API keys"): a deployment started
with `kdn-launch up --api-keys FILE` of the tiny model. Through the official
openai client: no key and a wrong key get 401 with an OpenAI error body, a
right key 200; /health and /metrics need none, the status page does. A tenant's prefix is never
reported as cached to another tenant, with or without cache_salt, while two
keys of one tenant share its cache.
"""

import random

import httpx
import openai
import pytest

from deploy_util import Deployment
from test_api import words_text

KEYS = {"alice-key-0123456789": "alice", "alice-key-second-one": "alice",
        "bob-key-9876543210abc": "bob"}


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("run-keys")
    keys = run / "api-keys"
    keys.write_text("# key tenant\n" + "".join("%s %s\n" % kv for kv in KEYS.items()))
    d = Deployment(run, tiny_model, "--api-keys", keys, api_key="alice-key-0123456789")
    try:
        yield d
    finally:
        d.down()


def client(deployment, key):
    return openai.OpenAI(base_url=deployment.url + "/v1", api_key=key, max_retries=0,
                         timeout=60.0)


def cached(usage):
    return (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0


def test_a_missing_or_wrong_key_is_401_and_a_right_one_200(keyed):
    for key in ("not-a-key", "alice-key-012345678", "alice-key-0123456789x"):
        with pytest.raises(openai.AuthenticationError) as e:
            client(keyed, key).completions.create(model=keyed.model_name, prompt="Hi",
                                                  max_tokens=2)
        assert e.value.status_code == 401
        assert e.value.code == "invalid_api_key", e.value.body
    # No key at all (the openai client always sends one).
    r = httpx.post(keyed.url + "/v1/completions", json={"model": keyed.model_name, "prompt": "x"})
    assert r.status_code == 401
    body = r.json()["error"]
    assert body["type"] == "invalid_request_error" and "Bearer" in body["message"]
    for key in KEYS:
        out = client(keyed, key).completions.create(model=keyed.model_name, prompt="Hi",
                                                    max_tokens=2)
        assert out.choices[0].text is not None
    assert client(keyed, "bob-key-9876543210abc").models.list().data[0].id == keyed.model_name


def test_health_and_metrics_need_no_key(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_the_status_page_asks_a_browser_for_a_key(keyed):
    """/, /status and /status.json are behind the keys: without one, 401 and
    a Basic challenge (a browser then asks for it); a key as the Basic
    password or as a bearer gets them."""
    for path in ("/", "/status", "/status.json"):
        r = httpx.get(keyed.url + path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"].startswith("Basic "), r.headers
        r = httpx.get(keyed.url + path, auth=("anyone", "not-a-key-at-all-123"))
        assert r.status_code == 401, path
        r = httpx.get(keyed.url + path, auth=("anyone", "bob-key-9876543210abc"))
        assert r.status_code == 200, path
        r = httpx.get(keyed.url + path,
                      headers={"Authorization": "Bearer alice-key-0123456789"})
        assert r.status_code == 200, path
    # The API's own 401 asks for a bearer, not a browser's credentials.
    r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and "www-authenticate" not in r.headers


def test_tenants_never_see_each_others_prefixes(keyed):
    prompt = words_text(random.Random(77), 700)
    alice, alice2, bob = (client(keyed, k) for k in KEYS)

    def send(c, **extra):
        return c.completions.create(model=keyed.model_name, prompt=prompt, max_tokens=2,
                                    temperature=0, extra_body=extra or None).usage

    assert cached(send(alice)) == 0
    assert cached(send(alice)) > 0  # alice's own prefix
    assert cached(send(alice2)) > 0  # another key of the same tenant
    assert cached(send(bob)) == 0  # never alice's
    # No salt reaches another tenant's namespace, nor the shared one of a
    # deployment without keys.
    for salt in ("alice", "tenant:5:alice:", ":alice", ""):
        assert cached(send(bob, cache_salt=salt)) == (0 if salt else cached(send(bob))), salt
    # A salt narrows a tenant's own cache.
    assert cached(send(alice, cache_salt="project-x")) == 0
    assert cached(send(alice, cache_salt="project-x")) > 0
