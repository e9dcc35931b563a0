#!/usr/bin/env python3
"""Where a request's time goes, from the processes' own logs.

Reads the logs of a deployment (RUN_DIR/logs/*.log as kdn-launch writes them,
or the files named) and puts each request's milestones (docs/serving.md,
"Logs": the router's accepted, routed, prefill done, finished; the prefill
worker's received, KDN, computed, KV sent; the decode worker's prepare,
prepared, local prefill, start, finished) in time order across processes.
For each request it prints the time of every milestone from the router's
`accepted` and the gap since the one before, with the figures the workers
measure themselves (the KDN load and compute milliseconds of the prefill
worker). Then, for each group of requests (KV reused or not, computed by a
prefill worker or by the decode worker's local prefill), the medians of the
time to the first token (the router's `accepted` to its `prefill done`) and
of the time at which each milestone before it comes: where that time goes.
At log level debug the workers' answers to the router's lookups are
milestones too.

    scripts/request-phases.py RUN_DIR [--since TIME] [--last N] [--req ID] [--json FILE]
    scripts/request-phases.py FILE.log [FILE.log ...]

Timestamps have millisecond resolution, so gaps under a few milliseconds are
rounded. The logs must be at level info or lower. Standard library only.
"""

import argparse
import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^(\S+Z)\s+(\w+)\s+(\S+)\s+req=([0-9a-f]{16})\s+(.*)$")
# A milestone is the message up to its first ':' (or " by ", for the
# router's "prefill done by prefill-0 (local): ..."), after the role.
CUT = re.compile(r"^(.*?)(?: by [^:]*)?:")
FIGURES = [
    ("kdn_load_ms", re.compile(r"loaded in ([0-9.]+) ms")),
    ("compute_ms", re.compile(r"; ([0-9.]+) ms in all")),
    ("first_token_ms", re.compile(r"first token after ([0-9.]+) ms")),
]
ACCEPTED = re.compile(r"accepted \S+: (\d+) prompt tokens")
FINISHED = re.compile(r"(\d+) prompt tokens \((\d+) cached\)")


def parse_time(stamp):
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def read(paths):
    """{request id: [(time, milestone, message)]}, each list in time order."""
    reqs = {}
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = LINE.match(line.rstrip("\n"))
                if not m:
                    continue
                stamp, _level, proc, rid, msg = m.groups()
                cut = CUT.match(msg)
                if not cut:
                    continue
                role = proc.split("/")[0]
                # "accepted /v1/completions" is the milestone "accepted".
                name = re.sub(r" /\S+", "", cut.group(1).split(" (")[0]).strip()
                milestone = role + " " + name
                try:
                    t = parse_time(stamp)
                except ValueError:
                    continue
                reqs.setdefault(rid, []).append((t, milestone, msg))
    # In time order (stable: a process's own order kept); the router's
    # `accepted` first among lines of the same millisecond, as it is.
    for events in reqs.values():
        events.sort(key=lambda e: (e[0], e[1] != "router accepted"))
    return reqs


def accepted_at(events):
    return next(e[0] for e in events if e[1] == "router accepted")


def summarize(rid, events):
    """One request's milestones, gaps and figures; None without the router's
    `accepted` (a document part, or a log cut short)."""
    start = next((e for e in events if e[1] == "router accepted"), None)
    if start is None:
        return None
    t0 = start[0]
    out = {"id": rid, "milestones": [], "figures": {}}
    m = ACCEPTED.search(start[2])
    out["prompt_tokens"] = int(m.group(1)) if m else None
    out["cached_tokens"] = None
    prev = t0
    for t, milestone, msg in events:
        out["milestones"].append({"milestone": milestone, "ms": (t - t0) * 1e3,
                                  "gap_ms": (t - prev) * 1e3})
        prev = t
        for name, rx in FIGURES:
            f = rx.search(msg)
            if f:
                out["figures"][name] = float(f.group(1))
        if milestone == "router finished":
            f = FINISHED.search(msg)
            if f:
                out["cached_tokens"] = int(f.group(2))
        if milestone == "router prefill done" and "ttft_ms" not in out:
            out["ttft_ms"] = (t - t0) * 1e3
            out["local"] = "(local)" in msg
    return out


def ttft_window(r):
    """The milestones up to the router's `prefill done` (the first token),
    and the gaps between them."""
    out = []
    for m in r["milestones"]:
        out.append(m)
        if m["milestone"] == "router prefill done":
            break
    return out


def medians(requests):
    """Over `requests`: the median of TTFT and of the workers' own figures,
    and of the time from the router's `accepted` at which each milestone
    inside the TTFT window first comes (in how many of the requests)."""
    at, figs = {}, {}
    for r in requests:
        seen = set()
        for m in ttft_window(r):
            if m["milestone"] not in seen:
                seen.add(m["milestone"])
                at.setdefault(m["milestone"], []).append(m["ms"])
        if "ttft_ms" in r:
            figs.setdefault("ttft_ms", []).append(r["ttft_ms"])
        for k, v in r["figures"].items():
            figs.setdefault(k, []).append(v)
    med = statistics.median
    return ({k: {"median_ms": med(v), "requests": len(v)} for k, v in at.items()},
            {k: {"median_ms": med(v), "requests": len(v)} for k, v in figs.items()})


def groups(rows):
    """The requests by whether they reused KV and by path."""
    out = {}
    for r in rows:
        if r["cached_tokens"] is None or "ttft_ms" not in r:
            continue  # unfinished, or no first token
        name = "%s, %s" % ("KV reused" if r["cached_tokens"] > 0 else "no KV reused",
                           "local prefill" if r.get("local") else "prefill worker")
        out.setdefault(name, []).append(r)
    return out


def print_medians(title, requests):
    at, figs = medians(requests)
    print("%s: %d requests; medians" % (title, len(requests)))
    for k, v in sorted(figs.items()):
        print("  %-40s %9.1f ms" % (k, v["median_ms"]))
    print("  milestones up to the first token, from the router's accepted:")
    for k, v in sorted(at.items(), key=lambda kv: kv[1]["median_ms"]):
        print("  %-40s %9.1f ms  (%d requests)" % (k, v["median_ms"], v["requests"]))


def print_request(r):
    print("req=%s: %s prompt tokens, %s cached%s, TTFT %s" % (
        r["id"], r["prompt_tokens"], r["cached_tokens"], " (local prefill)" if r.get("local") else "",
        "%.1f ms" % r["ttft_ms"] if "ttft_ms" in r else "-"))
    for m in r["milestones"]:
        print("  %9.1f ms  +%8.1f  %s" % (m["ms"], m["gap_ms"], m["milestone"]))
    if r["figures"]:
        print("  the workers' own: " + ", ".join("%s %.1f" % kv for kv in sorted(r["figures"].items())))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="a run folder (its logs/*.log) or log files")
    ap.add_argument("--last", type=int, default=0, help="print only the last N requests (all by default)")
    ap.add_argument("--req", help="print only this request id")
    ap.add_argument("--since", metavar="TIME",
                    help="only requests the router accepted at or after TIME (UTC, as the logs "
                    "write it: 2026-11-27T16:04:18.177Z)")
    ap.add_argument("--json", help="also write every request's phases and the medians here")
    a = ap.parse_args()
    files = []
    for p in map(Path, a.paths):
        if p.is_dir():
            logs = sorted((p / "logs").glob("*.log")) or sorted(p.glob("*.log"))
            if not logs:
                sys.exit("request-phases: no *.log in %s or %s/logs" % (p, p))
            files += logs
        elif p.is_file():
            files.append(p)
        else:
            sys.exit("request-phases: no such file or folder: %s" % p)
    reqs = read(files)
    rows = [s for s in (summarize(rid, ev) for rid, ev in reqs.items()) if s is not None]
    rows.sort(key=lambda r: accepted_at(reqs[r["id"]]))
    if a.since:
        try:
            since = parse_time(a.since)
        except ValueError:
            sys.exit("request-phases: --since takes a time as the logs write it "
                     "(2026-11-27T16:04:18.177Z), not %r" % a.since)
        rows = [r for r in rows if accepted_at(reqs[r["id"]]) >= since]
    if a.req:
        rows = [r for r in rows if r["id"] == a.req]
        if not rows:
            sys.exit("request-phases: no request %s with a router 'accepted' line in %s"
                     % (a.req, ", ".join(map(str, files))))
    if not rows:
        sys.exit("request-phases: no request with a router 'accepted' line in %s (log level info?)"
                 % ", ".join(map(str, files)))
    shown = rows[-a.last:] if a.last > 0 else rows
    for r in shown:
        print_request(r)
    summary = {}
    for name, rs in sorted(groups(rows).items()):
        print_medians(name, rs)
        at, figs = medians(rs)
        summary[name] = {"requests": len(rs), "milestones": at, "figures": figs}
    if a.json:
        Path(a.json).write_text(json.dumps({"requests": rows, "groups": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
