#!/usr/bin/env python3
"""The table at the end of scripts/gpu-check.sh: every figure a run left in
its results folder, with its aim and whether it met it.

    scripts/gpu-figures.py OUT_DIR [--markdown]

Reads what the steps wrote there (gtest logs, kdn-bench --json files, the
deployment check's and request-phases.py's JSON); a step that did not run
leaves no row, a step that ran and wrote nothing leaves a row saying so.
A figure with an aim shows `pass` or `short`; one without shows `-`.
Exits 0 whatever the figures: the script's own exit code says whether steps
failed. Standard library only.
"""

import json
import re
import sys
from pathlib import Path


def load(out, name):
    p = out / name
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return {"_unreadable": str(p)}


def gtest(out, log):
    """'N/M passed' of a gtest log, or None when the log is not there."""
    p = out / log
    if not p.is_file():
        return None
    text = p.read_text(errors="replace")
    ran = re.search(r"\[==========\] (\d+) tests? from", text)
    passed = re.search(r"\[  PASSED  \] (\d+) test", text)
    skipped = re.search(r"\[  SKIPPED \] (\d+) test", text)
    if not ran:
        return ("did not finish (see %s)" % log, False)
    n, ok = int(ran.group(1)), int(passed.group(1)) if passed else 0
    s = int(skipped.group(1)) if skipped else 0
    return ("%d/%d passed%s" % (ok, n, ", %d skipped" % s if s else ""), ok + s == n)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    markdown = "--markdown" in sys.argv[2:]
    rows = []  # (figure, value, aim, verdict)

    def add(figure, value, aim="", ok=None):
        value = value if len(value) <= 60 else value[:57] + "..."
        rows.append((figure, value, aim or "-", "-" if ok is None else ("pass" if ok else "short")))

    for log, what in [("cuda_tests.log", "kdn_cuda_tests"),
                      ("kvbus_cuda_tests.log", "kdn_kvbus_cuda_tests")]:
        g = gtest(out, log)
        if g:
            add(what, g[0], "all pass", g[1])
    d = load(out, "smollm2_deploy.json")
    if d:
        add("SmolLM2 deployment vs kdn-generate (GPU)",
            "%d/%d turns equal, repeat cached %s" % (d.get("equal", 0), d.get("turns", 0),
                                                   d.get("repeat_cached_tokens")),
            "every turn equal, repeat reuses KV", d.get("ok", False))
    d = load(out, "cuda_ipc.json")
    if d and "results" in d:
        for r in d["results"]:
            if "skipped" in r:
                add("cuda-ipc %s" % r["path"], "skipped: " + r["skipped"])
                continue
            frac = r["fraction_of_device_copy"]
            aim = ">= 0.80 of cudaMemcpy" if r["path"] == "cuda_ipc" else ""
            add("cuda-ipc %s, 16K llama3-8b" % r["path"],
                "%.2f of copy, %.1f GB/s, check %s" % (frac, r["gbytes_per_s"], r["check"]),
                aim, (frac >= 0.8 and r["check"] == "OK") if aim else None)
    d = load(out, "planes.json")
    if d and "rows" in d:
        for r in d["rows"]:
            if "error" in r:
                add("SmolLM2 --kv-transport %s" % r["transport"], "did not come up")
                continue
            dec = r.get("decode") or {}
            add("SmolLM2 --kv-transport %s" % r["transport"],
                "%d/%d equal, 4K TTFT %.0f ms, start copy %d B, by %s, %d sourced" % (
                    r["equal"], r["turns"], r["ttft_ms_median"], dec.get("start_copy_bytes", -1),
                    ",".join(k for k, v in sorted(dec.get("planes", {}).items()) if v > 0),
                    dec.get("slices_sourced", 0)),
                "equal, %s only, sourced, no start copy" % r["transport"]
                if r["transport"] in ("cuda_ipc", "nccl") else "",
                d.get("ok", False) if r["transport"] == "cuda_ipc"
                else d.get("nccl_ok", False) if r["transport"] == "nccl" else None)
        for plane in ("cuda_ipc", "nccl"):
            if plane + "_vs_host_ttft" in d:
                add("4K TTFT %s / host path" % plane, "%.2fx" % d[plane + "_vs_host_ttft"])
    d = load(out, "multiturn.json")
    if d and "first_to_later_ttft_ratio" in d:
        aims = {"resident": 10, "local": 20}
        for mode, v in d["first_to_later_ttft_ratio"].items():
            a = aims.get(mode)
            add("multiturn 16K first/later, %s" % mode, "%.1fx" % v,
                ">= %dx" % a if a else "", v >= a if a else None)
    for name, what in [("rag_blend.json", "rag-blend"), ("rag_blend_progressive.json",
                                                          "rag-blend progressive")]:
        d = load(out, name)
        if d and "blend_015_speedup" in d:
            v = d["blend_015_speedup"]
            add("%s 0.15 vs full prefill" % what, "%.2fx" % v, ">= 3x", v >= 3)
    d = load(out, "blend_fidelity.json")
    if d and "rows" in d:
        # The aims (docs/blend.md) are a trained model's: a generated one
        # (a preset's random weights) shows its figures without them.
        trained = not str(d.get("model", "")).startswith("preset")
        for r in d["rows"]:
            if abs(r.get("ratio", 0) - 0.15) > 1e-6 or r.get("mode") == "random":
                continue
            label = "blend-fidelity%s %s%s" % ("" if trained else " (generated)", r["mode"],
                                               " " + ",".join(map(str, r["check_layers"]))
                                               if r.get("check_layers") else "")
            kl, top1 = r["kl_vs_full_reuse"], r["top1_agreement"]
            add(label + " KL / full reuse", "%.3f" % kl, "<= 0.25" if trained else "",
                kl <= 0.25 if trained else None)
            add(label + " top-1", "%.3f" % top1, ">= 0.95" if trained else "",
                top1 >= 0.95 if trained else None)
            add(label + " TTFT vs full", "%.2fx" % r["speedup"])
    d = load(out, "deploy_multiturn.json")
    if d:
        for run in d.get("paths", [d]):
            path = run.get("disaggregation") or "default"
            if run.get("first_to_later_ttft_ratio") is not None:
                add("deployment multiturn first/later, %s" % path,
                    "%.1fx" % run["first_to_later_ttft_ratio"], ">= 10x",
                    run["first_to_later_ttft_ratio"] >= 10)
            if run.get("later_to_floor_ttft_ratio") is not None:
                add("deployment multiturn later/floor, %s" % path,
                    "%.2fx" % run["later_to_floor_ttft_ratio"], "<= 1.5x",
                    run["later_to_floor_ttft_ratio"] <= 1.5)
    for name in ["deploy_serve_load.json", "deploy_serve_load_chat.json"]:
        d = load(out, name)
        if not d:
            continue
        for run in d.get("paths", [d]):
            path = run.get("disaggregation") or "default"
            label = "serve-load%s %s" % (" chat" if "chat" in name else "", path)
            if "requests_per_s" in run:
                add(label, "%.1f requests/s, TTFT p50 %.0f ms" % (run["requests_per_s"],
                                                                  run.get("ttft_ms_p50", 0)))
            if "errors" in run:
                add(label + " errors", str(run["errors"]), "0", run["errors"] == 0)
    d = load(out, "turn_phases.json")
    if d:
        # Where a later turn's time to the first token goes, per path: its
        # median, and when the router had placed it (the workers' lookups
        # answered).
        for group, g in sorted((d.get("groups") or {}).items()):
            if not group.startswith("KV reused"):
                continue
            path = group[len("KV reused, "):]
            ttft = g["figures"].get("ttft_ms", {}).get("median_ms")
            if ttft is not None:
                add("later turns, %s: TTFT median (%d)" % (path, g["requests"]), "%.1f ms" % ttft)
            routed = g["milestones"].get("router routed", {}).get("median_ms")
            if routed is not None:
                add("  of it, placed (lookups answered)", "%.1f ms" % routed)
    for name in sorted(out.glob("*.json")):
        d = load(out, name.name)
        if isinstance(d, dict) and "_unreadable" in d:
            add(name.name, "unreadable JSON")

    if not rows:
        print("gpu-figures: no figures in %s" % out)
        return
    w = [max(len(r[i]) for r in rows + [("figure", "value", "aim", "")]) for i in range(3)]
    if markdown:
        print("| figure | value | aim | |\n|---|---|---|---|")
        for r in rows:
            print("| %s | %s | %s | %s |" % r)
        return
    print("%-*s  %-*s  %-*s  %s" % (w[0], "figure", w[1], "value", w[2], "aim", ""))
    for r in rows:
        print("%-*s  %-*s  %-*s  %s" % (w[0], r[0], w[1], r[1], w[2], r[2], r[3]))


if __name__ == "__main__":
    main()
