"""What every part of kdn-launch uses: its errors, its messages, atomic JSON
files, the end of a log and one HTTP GET."""

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

# The source tree: launch/kdn_launch/util.py is two folders down.
REPO = Path(__file__).resolve().parent.parent.parent
LOG_TAIL_LINES = 20


class Failure(Exception):
    """A failure to report on one line (exit code 1)."""


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP reached the launcher."""


def info(msg):
    print("kdn: " + msg, file=sys.stderr, flush=True)


def log_tail(path, lines=LOG_TAIL_LINES):
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return "  (no log at %s)" % path
    if not text:
        return "  (%s is empty)" % path
    return "\n".join("  | " + line for line in text[-lines:])


def write_json(path, value):
    """Writes `value` to `path` whole or not at all (a temporary file, then
    a rename), so that a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def http_get(url, timeout=3.0):
    """(status, body text); status 0 and the reason when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))
