"""Logs (docs/serving.md, "Logs"): one request's story, followed across the
router's, the prefill worker's and the decode worker's log files by the id
the router returns in X-Request-Id; and --log-level."""

import json
import re
import subprocess
import sys
from pathlib import Path

from deploy_util import REPO, Deployment, sse_events, wait_until

# ISO 8601 UTC with milliseconds, the level, the process, the message.
LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (trace|debug|info |warn |error) "
                  r"(\S+) (.*)$")

# The milestones each process logs for a completion, in order.
MILESTONES = {
    "router": ["accepted /v1/completions", "routed:", "prefill done", "finished:"],
    "prefill-0": ["received:", "KDN:", "computed:", "KV sent:"],
    "decode-0": ["prepare:", "prepared:", "start:", "finished:"],
}
ROLES = {"router": "router", "prefill-0": "prefill/prefill-0", "decode-0": "decode/decode-0"}


def log_lines(d, name):
    path = next(p["log"] for p in d.info["processes"] if p["name"] == name)
    return Path(path).read_text(errors="replace").splitlines()


def request_lines(d, name, request_id):
    token = "req=" + request_id
    return [l for l in log_lines(d, name) if token in l.split()]


def story(d, request_id):
    """{process: its lines of the request}, once every milestone is there
    (a worker may write its last line just after the client has the answer)."""
    def complete():
        found = {n: request_lines(d, n, request_id) for n in MILESTONES}
        if all(len(found[n]) >= len(m) for n, m in MILESTONES.items()):
            return found
        return None
    found = wait_until(complete, 10)
    assert found, "the story of %s is incomplete:\n%s" % (request_id, d.log_tails(30))
    return found


def check_story(found, request_id):
    for name, milestones in MILESTONES.items():
        lines = found[name]
        parsed = [LINE.match(l) for l in lines]
        assert all(parsed), "not timestamp, level, process, message:\n%s" % "\n".join(lines)
        for m in parsed:
            assert m.group(3) == ROLES[name], m.group(0)
            assert m.group(4).startswith("req=%s " % request_id), m.group(0)
        messages = [m.group(4)[len("req=") + 16 + 1:] for m in parsed]
        at = 0
        for milestone in milestones:
            hits = [i for i, msg in enumerate(messages) if msg.startswith(milestone)]
            assert hits, "%s has no %r line for %s:\n%s" % (name, milestone, request_id,
                                                           "\n".join(lines))
            assert hits[0] >= at, "%s: %r comes out of order:\n%s" % (name, milestone,
                                                                     "\n".join(lines))
            at = hits[0]
            assert parsed[hits[0]].group(2) == "info ", parsed[hits[0]].group(0)
        # The timestamps never go back.
        stamps = [m.group(1) for m in parsed]
        assert stamps == sorted(stamps), lines


def greedy_on_the_prefill_worker(deployment, prompt, max_tokens):
    """A completion on the prefill worker's path (whose milestones MILESTONES
    lists): the response."""
    r = deployment.http.post("/v1/completions",
                             json={"prompt": prompt, "max_tokens": max_tokens,
                                   "temperature": 0, "ignore_eos": True,
                                   "disaggregation": "always"})
    assert r.status_code == 200, r.text
    return r


def test_one_request_can_be_followed_across_the_logs_by_its_id(deployment):
    r = greedy_on_the_prefill_worker(deployment, "Follow me through the logs", 4)
    request_id = r.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{16}", request_id), request_id
    body = r.json()
    assert body["id"] == "cmpl-" + request_id, body["id"]
    found = story(deployment, request_id)
    check_story(found, request_id)
    router = "\n".join(found["router"])
    assert "finished: length, 27 prompt tokens (0 cached), 4 completion tokens, 200" in router, \
        router
    # The KV's transfer is named alike on both sides of it.
    sent = next(l for l in found["prefill-0"] if " KV sent: " in l)
    started = next(l for l in found["decode-0"] if " start: " in l)
    transfer = re.search(r"\(transfer ([0-9a-f]{32})\)", sent).group(1)
    assert "(transfer %s)" % transfer in started, (sent, started)
    # The next request has another id, and no line of this one carries it.
    again = deployment.http.post("/v1/completions",
                                 json={"prompt": "Another one", "max_tokens": 1})
    other = again.headers["X-Request-Id"]
    assert other != request_id
    assert all("req=" + other not in l for lines in found.values() for l in lines)


def test_request_phases_puts_a_requests_milestones_in_order_from_the_logs(deployment, tmp_path):
    """scripts/request-phases.py (where a request's time goes): the router's,
    the prefill worker's and the decode worker's milestones of one request,
    merged in time order, with the prefill worker's own figures."""
    request_id = greedy_on_the_prefill_worker(deployment, "Where does my time go?", 3).headers[
        "X-Request-Id"]
    story(deployment, request_id)
    out = tmp_path / "phases.json"
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "request-phases.py"),
                        str(deployment.run_dir), "--req", request_id, "--json", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "req=%s: 23 prompt tokens, 0 cached" % request_id in p.stdout, p.stdout
    req = next(q for q in json.loads(out.read_text())["requests"] if q["id"] == request_id)
    names = [m["milestone"] for m in req["milestones"]]
    assert names[0] == "router accepted", names
    # Each milestone no earlier than the one that causes it (the logs have
    # milliseconds: lines of one millisecond may come in either order).
    at = {}
    for m in req["milestones"]:
        at.setdefault(m["milestone"], m["ms"])
    for a, b in [("router accepted", "router routed"), ("router routed", "prefill received"),
                 ("prefill received", "prefill computed"), ("prefill computed", "router prefill done"),
                 ("router prefill done", "router finished")]:
        assert at[a] <= at[b], (a, b, req["milestones"])
    assert {"decode prepare", "decode start", "prefill KDN", "prefill KV sent"} <= set(names), names
    stamps = [m["ms"] for m in req["milestones"]]
    assert stamps == sorted(stamps) and stamps[0] == 0, stamps
    assert 0 <= req["ttft_ms"] <= stamps[-1], req
    assert req["figures"]["compute_ms"] >= 0 and "kdn_load_ms" in req["figures"], req["figures"]
    # An id that is not in the logs is refused, saying so.
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "request-phases.py"),
                        str(deployment.run_dir), "--req", "0" * 16], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "no request" in p.stderr, p.stdout + p.stderr


def test_a_streamed_chat_carries_its_id_in_the_header_and_the_chunks(deployment):
    with deployment.http.stream("POST", "/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 3, "stream": True,
                                      "disaggregation": "always"}) as r:
        assert r.status_code == 200
        request_id = r.headers["X-Request-Id"]
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert '"id":"chatcmpl-%s"' % request_id in events[0], events[0]
    found = story(deployment, request_id)
    assert any("accepted /v1/chat/completions" in l for l in found["router"]), found["router"]


def test_log_level_error_silences_info_lines(tiny_model, tmp_path):
    d = Deployment(tmp_path / "run", tiny_model, "--log-level", "error")
    try:
        r = d.http.post("/v1/completions", json={"prompt": "quiet please", "max_tokens": 2})
        assert r.status_code == 200, r.text
        request_id = r.headers["X-Request-Id"]
        cmds = {p["name"]: p["cmd"] for p in d.info["processes"]}
        for name, cmd in cmds.items():
            assert cmd[cmd.index("--log-level") + 1] == "error", cmd
        for name in ("router", "prefill-0", "decode-0"):
            lines = log_lines(d, name)
            assert not [l for l in lines if " info " in l or "req=" + request_id in l], \
                "%s logs below error:\n%s" % (name, "\n".join(lines))
    finally:
        d.down()
