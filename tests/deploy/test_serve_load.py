"""kdn-bench serve-load (docs/serving.md, "Load"): many clients, documents
reused under a Zipf law, against a running deployment. Its figures must add
up: no errors, cache hits on the reused documents, every KV block back once
the load is over, each process's RSS read.
"""

import json
import subprocess

from deploy_util import binary


def test_serve_load_reports_a_clean_run(deployment, tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run([binary("kdn-bench"), "serve-load", "--url", deployment.url,
                        "--clients", "4", "--requests", "40", "--documents", "6",
                        "--doc-chars", "700", "--max-tokens", "6", "--seed", "11",
                        "--run-dir", str(deployment.run_dir), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["errors"] == 0, res["error_kinds"]
    assert res["requests"] == 40
    assert res["ttft_ms_p50"] > 0 and res["ttft_ms_p99"] >= res["ttft_ms_p50"]
    assert res["itl_ms_p50"] > 0
    # Six documents over forty requests: most prompts repeat one.
    assert res["hit_rate"] > 0.3, res["hit_rate"]
    assert res["kv_blocks_leaked"] == 0, res["free_kv_blocks_lost"]
    # The decode worker's leases were read, and none is held once drained.
    assert any(k.startswith("kdn_worker_leased_kv_blocks{") and 'worker="decode-0"' in k
               for k in res["leases_held_after"]), res["leases_held_after"]
    assert res["leases_held"] == 0, res["leases_held_after"]
    assert set(res["rss"]) == {"prefill-0", "decode-0", "router"}, res["rss"]
    assert all(v["end_mib"] > 0 for v in res["rss"].values())
    assert "goodput" in r.stdout and "KDN hit rate" in r.stdout
