"""The router's status page (docs/serving.md, "Status page") on a running
deployment of the tiny model: /status.json names the workers /health names
and counts requests; the page at / and /status, loaded in a real browser
(Debian's headless `chromium`), shows the deployment's workers and a request
count that grows after requests are sent, draws its charts, logs nothing to
the console, and a screenshot of it is taken.
"""

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_status_json_names_the_workers_and_counts_requests(deployment):
    health = deployment.http.get("/health").json()
    status = deployment.http.get("/status.json")
    assert status.status_code == 200
    s = status.json()
    assert [w["name"] for w in s["workers"]] == [w["name"] for w in health["workers"]]
    assert s["model"] == health["model"] and s["status"] == "ok"
    for w in s["workers"]:
        assert w["device"] == "cpu", w
        assert w["total_kv_blocks"] > 0, w
        assert w["store_tiers"] and w["store_tiers"][0]["name"] == "host", w
        assert w["store_tiers"][0]["held_here"] is True, w
        assert "hit_tokens" in w["resident"], w
    before = s["router"]
    deployment.completion("The status page counts this", max_tokens=2)
    after = deployment.http.get("/status.json").json()["router"]
    assert after["requests_total"] >= before["requests_total"] + 2  # and the first status.json
    assert after["api_requests_total"] >= before["api_requests_total"] + 1
    assert sum(i["requests"] for i in after["history"]) >= 1
    assert after["ttft"]["count"] >= 1
    for path in ("/", "/status"):
        page = deployment.http.get(path)
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert 'fetch("status.json"' in page.text
    assert deployment.http.get("/favicon.ico").status_code == 204


def load_in_chromium(url, out_dir, name):
    """Loads `url` in headless Chromium, lets its script run, and returns
    (the DOM after it ran, what Chromium logged); writes NAME.png."""
    out_dir = Path(out_dir)
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-extensions", "--user-data-dir=%s" % (out_dir / "profile"),
            "--window-size=1280,1000", "--virtual-time-budget=4000",
            "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = out_dir / (name + ".png")
    png = subprocess.run(base + ["--screenshot=%s" % shot, url], capture_output=True, text=True,
                         timeout=120)
    assert png.returncode == 0, png.stderr[-2000:]
    assert shot.stat().st_size > 10_000, "the screenshot is empty"
    return dom.stdout, dom.stderr + png.stderr


def shown_count(dom, element_id):
    m = re.search(r'id="%s"[^>]*>([0-9,]+)<' % element_id, dom)
    assert m, "no #%s in the page's DOM" % element_id
    return int(m.group(1).replace(",", ""))


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(scripts/install-deps.sh --ref installs it)")
def test_the_status_page_in_a_real_browser(deployment, tmp_path):
    workers = [w["name"] for w in deployment.http.get("/health").json()["workers"]]
    dom, log = load_in_chromium(deployment.url + "/", tmp_path, "status-before")
    for name in workers:
        assert 'data-worker="%s"' % name in dom, "worker %s not shown:\n%s" % (name, dom[:3000])
    assert dom.count("<path d=\"M") >= 1, "no chart drawn"
    assert 'id="banner" style="display: none;"' in dom, "the page could not read status.json"
    before = shown_count(dom, "requests-total")
    for i in range(3):
        deployment.completion("Counting requests %d" % i, max_tokens=2)
    dom, log2 = load_in_chromium(deployment.url + "/status", tmp_path, "status-after")
    after = shown_count(dom, "requests-total")
    assert after >= before + 3, (before, after)
    console = [line for line in (log + log2).splitlines() if "CONSOLE" in line]
    assert not console, "the page logged to the console:\n" + "\n".join(console)


def test_status_json_shows_a_shared_store_as_each_worker_counts_it(store_deployment):
    """With kdn-store, each worker's tiers are its host tier (held there) and
    the store (shared: its contents not asked for, its reads this worker's)."""
    s = store_deployment.http.get("/status.json").json()
    for w in s["workers"]:
        names = [t["name"] for t in w["store_tiers"]]
        assert names[0] == "host" and names[1].startswith("remote tcp://"), w
        shared = w["store_tiers"][1]
        assert shared["held_here"] is False and shared["chunks"] == 0, shared
