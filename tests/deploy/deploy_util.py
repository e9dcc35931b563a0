"""Helpers of the deployment tests: where things are, starting and stopping a
deployment through launch/kdn-launch, reading /metrics and server-sent events.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(os.environ.get("KDN_REPO") or Path(__file__).resolve().parents[2]).resolve()
BIN_DIR = Path(os.environ.get("KDN_BIN_DIR") or REPO / "build" / "bin").resolve()
LAUNCH = REPO / "launch" / "kdn-launch"

# The generated tiny model: 2 layers, context 2048, byte-level tokenizer (ids
# 0-255 are bytes, 256 BOS, 257 EOS), so N ASCII characters are N + 1 tokens.
TINY_CONTEXT = 2048
CHUNK_TOKENS = 256  # kdn-launch's default --chunk-tokens
MIN_TAIL_TOKENS = 16  # kvbus::kMinTailTokens


def _tail_pieces(length):
    """The piece sizes of a stored tail (docs/kvbus.md, "Tail keys"): an
    anchor token, then the binary digits of the rest, largest first."""
    if length <= 0:
        return []
    rest = length - 1
    return [1] + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


def repeat_cached(prompt_tokens, answer_tokens, chunk=CHUNK_TOKENS):
    """The cached_tokens of a prompt sent a second time, by the lookup that
    docs/kvbus.md specifies: its first request stored the prompt's full chunks
    and tail (prefill worker) and the conversation, prompt and all but the
    last answer token (decode worker). The prefill worker reuses at most all
    but the last token: the full chunks that fit, then the longest chain of
    stored tail pieces, probed largest first, if it covers MIN_TAIL_TOKENS."""
    limit = prompt_tokens - 1
    full = min(prompt_tokens // chunk, limit // chunk)
    first = full * chunk
    stored = [_tail_pieces(n - first) for n in (prompt_tokens, prompt_tokens + answer_tokens - 1)
              if n // chunk == full]
    path = []
    if any(stored):
        path = [1]
        size = 1 << max(chunk - 2, 1).bit_length() - 1
        while size >= 1:
            if sum(path) + size <= min(limit - first, chunk - 1) and any(
                    s[:len(path) + 1] == path + [size] for s in stored):
                path.append(size)
            size >>= 1
    tail = sum(path)
    return first + (tail if tail >= MIN_TAIL_TOKENS else 0)


def binary(name):
    path = BIN_DIR / name
    if not os.access(path, os.X_OK):
        raise RuntimeError("%s is missing: build first (scripts/build.sh), or set KDN_BIN_DIR" % path)
    return str(path)


def generate_ids(model, ids, max_tokens, *flags):
    """kdn-generate on the token ids `ids` (greedy, no BOS added, past the
    end-of-sequence token): its stdout, less the newline."""
    r = subprocess.run([binary("kdn-generate"), "--model", str(model), "--prompt-ids",
                        ",".join(map(str, ids)), "--no-bos", "--ignore-eos", "--max-tokens",
                        str(max_tokens), "--threads", "1", *flags],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout[:-1]


def settled_metrics(d):
    """The router's page once the workers' reports after the last request
    are in (they come with the router's pings, every 250 ms)."""
    time.sleep(1.0)
    return parse_metrics(d.metrics())


def make_model(preset, seed, out):
    subprocess.run([binary("kdn-mkmodel"), "--preset", preset, "--seed", str(seed), "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL, timeout=300)
    return Path(out)


def launch(*args, timeout=180, env=None):
    """Runs kdn-launch with KDN_BIN_DIR pointing at the binaries under test,
    in `env` (default: this process's environment)."""
    env = dict(os.environ if env is None else env, KDN_BIN_DIR=str(BIN_DIR))
    return subprocess.run([sys.executable, str(LAUNCH)] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def pid_alive(pid):
    """True while pid runs and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
        return not stat[stat.rindex(")") + 2:].startswith(("Z", "X"))
    except OSError:
        return False


class Deployment:
    """One deployment started with `kdn-launch up --detach --port 0`."""

    def __init__(self, run_dir, model, *up_args, api_key=None):
        self.run_dir = Path(run_dir)
        self.model = Path(model)
        r = launch("up", "--detach", "--port", 0, "--run-dir", self.run_dir, "--model", self.model,
                   "--threads", 1, "--ready-timeout", 60, *up_args)
        if r.returncode != 0:
            self.kill_leftovers()
            raise RuntimeError("kdn-launch up failed (exit code %d)\nstdout:\n%s\nstderr:\n%s"
                               % (r.returncode, r.stdout, r.stderr))
        self.http = None
        try:
            last = r.stdout.strip().splitlines()[-1]
            assert last.startswith("kdn: serving on http://"), r.stdout
            self.url = last.split()[-1]
            self.info = json.loads((self.run_dir / "deployment.json").read_text())
            assert self.info["url"] == self.url, (self.info["url"], self.url)
            headers = {"Authorization": "Bearer " + api_key} if api_key else {}
            self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(60.0),
                                     headers=headers)
            models = self.http.get("/v1/models")
            assert models.status_code == 200, "GET /v1/models -> %d %s" % (
                models.status_code, models.text[:300])
            self.model_name = models.json()["data"][0]["id"]
        except BaseException:
            self.down()
            raise

    def pid(self, name):
        return next(p["pid"] for p in self.info["processes"] if p["name"] == name)

    def pids(self):
        return [p["pid"] for p in self.info["processes"]]

    def log_tails(self, lines=15):
        out = []
        for p in self.info["processes"]:
            try:
                text = Path(p["log"]).read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                text = ["(no log)"]
            out.append("--- %s (%s)\n%s" % (p["name"], p["log"], "\n".join(text)))
        return "\n".join(out)

    def kill_leftovers(self):
        """SIGKILLs what deployment.json still names (after a failed down)."""
        try:
            info = json.loads((self.run_dir / "deployment.json").read_text())
        except (OSError, ValueError):
            return
        for p in info.get("processes", []):
            if pid_alive(p["pid"]):
                try:
                    os.kill(p["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def down(self):
        """`kdn-launch down`; returns its CompletedProcess."""
        if self.http is not None:
            self.http.close()
        try:
            r = launch("down", "--run-dir", self.run_dir, timeout=120)
        finally:
            self.kill_leftovers()
        return r

    # --- requests

    def completion(self, prompt, **fields):
        body = dict(prompt=prompt, **fields)
        r = self.http.post("/v1/completions", json=body)
        assert r.status_code == 200, "POST /v1/completions %s -> %d %s" % (
            json.dumps(body)[:200], r.status_code, r.text[:500])
        return r.json()

    def chat(self, messages, **fields):
        body = dict(messages=messages, **fields)
        r = self.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, "POST /v1/chat/completions %s -> %d %s" % (
            json.dumps(body)[:200], r.status_code, r.text[:500])
        return r.json()

    def metrics(self):
        r = self.http.get("/metrics")
        assert r.status_code == 200, "GET /metrics -> %d %s" % (r.status_code, r.text[:300])
        return r.text


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """{(name, frozenset(labels.items())): value} of a Prometheus text page."""
    samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, "not a Prometheus sample line: %r" % line
        labels = frozenset(_LABEL.findall(m.group(3) or ""))
        samples[(m.group(1), labels)] = float(m.group(4))
    return samples


def metric(samples, name, **labels):
    """The value of one sample (0 when absent: a counter not yet touched)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def metric_types(text):
    """{name: type} from the page's # TYPE lines."""
    types = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "#" and parts[1] == "TYPE":
            types[parts[2]] = parts[3]
    return types


def sse_events(lines):
    """Splits server-sent event lines into the `data:` payloads, in order."""
    events = []
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith("data:"):
            events.append(line[5:].strip())
        elif line and not line.startswith(":"):
            raise AssertionError("unexpected line in an event stream: %r" % line)
    return events


def wait_until(predicate, timeout, step=0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)
