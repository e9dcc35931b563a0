"""The one builder of every process's command line (kdn-store, kdn-prefill,
kdn-decode, kdn-router), for a local deployment (`up`, `demo`, `--dry-run`)
and for the Slurm job script alike: each flag of kdn-launch reaches the
processes it concerns from here, the same way in both. (redis-server takes
only its redis.conf: redis_cluster.py writes that.)

The two differ only in the words they pass in: the addresses to listen on,
the endpoints of the store and the workers, the router's host, and the
device flags. A local deployment knows them (or, for --dry-run, names them
NAME-ENDPOINT); the job script computes them when it runs, so for it they
are Shell words, written into the script as they are.

The flags whose default is the process's own (--max-batch, --max-queued,
--max-connections, --max-body-buffer-mib, --disaggregation,
--local-prefill-max-tokens, --local-prefill-step-tokens,
--decode-prepare-timeout-ms, --decode-admission-reserve) are passed when
given, whatever their value, and left out otherwise; every other flag is
always passed.
"""

import re
import shlex
from pathlib import Path


class Shell:
    """A word of a command line that the job script computes when it runs
    (e.g. "$(listen 0)", "$STORE"): written into the script as it is."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return "Shell(%r)" % self.text


def bash_words(argv):
    """`argv` as bash words: Shell words as they are, the others quoted."""
    return " ".join(w.text if isinstance(w, Shell) else shlex.quote(w) for w in argv)


def redact_url(word):
    """A URL (redis://, or any SCHEME://) with its credentials' password
    written as ***: what lies between the scheme and the URL's last @ is
    USER:PASSWORD, the password holding any character, / @ : included."""
    scheme, sep, rest = word.partition("://")
    if not sep or "@" not in rest:
        return word
    scheme += sep
    cred, _, hosts = rest.rpartition("@")
    user = cred.split(":", 1)[0] if ":" in cred else cred
    return "%s%s%s@%s" % (scheme, user, ":***" if ":" in cred else "", hosts)


def redacted(cmd):
    """`cmd` with the password of a --kdn-redis URL written as ***, for
    what the launcher records and prints (deployment.json, messages)."""
    return [w if isinstance(w, Shell) else redact_url(w) for w in cmd]


def curve_flags(a, role="member"):
    """--curve-keys for a process (the router's key for the router), unless
    the deployment runs plaintext (a.curve_keys unset)."""
    keys = getattr(a, "curve_keys", None)
    if not keys:
        return []
    return ["--curve-keys", str(keys[1] if role == "router" else keys[0])]


def log_flags(a):
    """--log-level for every process, when given: without it the processes
    log at $KDN_LOG_LEVEL (which they inherit), else info."""
    level = getattr(a, "log_level", None)
    return ["--log-level", level] if level else []


def given(flag, value):
    """[flag, value] when the flag was given; [] leaves the process's own default."""
    return [] if value is None else [flag, str(value)]


def store_argv(a, bin_dir, listen):
    return [str(Path(bin_dir) / "kdn-store"), "--listen", listen,
            "--host-mib", "%g" % a.store_host_mib] + curve_flags(a) + log_flags(a)


def worker_argv(a, bin_dir, model, name, role, listen, store, device, redis=None,
                redis_password_file=None):
    """kdn-prefill or kdn-decode (`role`) named `name`, listening on `listen`
    (a decode worker's kvbus too), reading and filling the kdn-store at
    `store` or the Redis Cluster at the URL `redis` (at most one of them; None:
    no store; the URL's password in `redis_password_file` if given), on
    `device` (a plan.WorkerDevice)."""
    assert store is None or redis is None, "a worker has one shared store"
    cmd = [str(Path(bin_dir) / ("kdn-" + role)), "--model", str(model), "--listen", listen,
           "--host-mib", "%g" % a.host_mib, "--chunk-tokens", str(a.chunk_tokens),
           "--threads", str(a.threads), "--weights-dtype", a.weights_dtype,
           "--kv-transport", a.kv_transport] + \
        curve_flags(a) + log_flags(a)
    if store is not None:
        cmd += ["--store", store, "--store-codec", a.store_codec]
    if redis is not None:
        cmd += ["--kdn-redis", redis, "--store-codec", a.store_codec]
        if redis_password_file is not None:
            cmd += ["--kdn-redis-password-file", redis_password_file]
    if role == "decode":
        cmd += ["--kvbus-listen", listen] + given("--max-batch", a.max_batch)
        cmd += given("--kv-tokens", getattr(a, "decode_kv_tokens", None))
        cmd += given("--local-prefill-step-tokens", a.local_prefill_step_tokens)
        cmd += given("--prepare-timeout-ms", getattr(a, "decode_prepare_timeout_ms", None))
        cmd += given("--admission-reserve", getattr(a, "decode_admission_reserve", None))
    return cmd + ["--name", name] + device.flags()


def router_argv(a, bin_dir, model, prefill, decode, host, port=None):
    """kdn-router over the prefill and decode workers at `prefill` and
    `decode` (comma-separated endpoints), serving HTTP on `host`, on `port`
    (None: --port)."""
    cmd = [str(Path(bin_dir) / "kdn-router"), "--model", str(model), "--prefill", prefill,
           "--decode", decode, "--host", host, "--port", str(a.port if port is None else port),
           "--recompute-ratio", repr(a.recompute_ratio)] + log_flags(a)
    cmd += given("--max-queued", a.max_queued) + given("--max-connections", a.max_connections)
    cmd += given("--max-body-buffer-mib", a.max_body_buffer_mib)
    cmd += given("--disaggregation", a.disaggregation)
    cmd += given("--max-pinned-mib", getattr(a, "max_pinned_mib", None))
    cmd += given("--local-prefill-max-tokens", a.local_prefill_max_tokens)
    if a.no_resume:
        cmd += ["--no-resume"]
    if a.separator:
        cmd += ["--separator", a.separator]
    if a.api_keys:
        cmd += ["--api-keys", str(Path(a.api_keys).resolve())]
    if getattr(a, "emphasis_heads", None):
        cmd += ["--emphasis-heads", str(Path(a.emphasis_heads).resolve())]
    cmd += given("--emphasis-strength", getattr(a, "emphasis_strength", None))
    return cmd + curve_flags(a, "router")
