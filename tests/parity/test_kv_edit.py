"""kdn-bench kv-edit (docs/kvbus.md, "Editing stored KV") on SmolLM2, a few
items: the rows it reports hold together (the unedited arm is its own
specificity reference, the re-prefill is its own cost baseline, only the
erratum and the steered copies cost an edit, an emphasis or a steering of
strength 0 is no edit), the set is built from every fact of the file, and a
malformed facts file is refused naming its line.
"""
import json
import os
import subprocess
from pathlib import Path

from gguf_micro import smollm2_path

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))
REPO = Path(__file__).resolve().parents[2]
FACTS = REPO / "bench" / "data" / "kv_edit_facts.txt"


def run(*args, facts=FACTS):
    cmd = [BIN / "kdn-bench", "kv-edit", "--model", smollm2_path(), "--threads", "1",
           "--facts", facts] + list(args)
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600)


def test_kv_edit_rows_hold_together(tmp_path):
    out = tmp_path / "kv-edit.json"
    done = run("--items", "4", "--fluency-items", "1", "--fluency-tokens", "8",
               "--bootstrap", "50", "--emphasize", "0,3", "--steer", "0,6", "--steer-pairs", "4",
               "--emphasize-profiled", "0,3", "--profile-items", "1", "--profile-heads", "4",
               "--json", out)
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    facts = sum(1 for line in FACTS.read_text().splitlines() if line.startswith("fact:"))
    assert r["facts_candidates"] == facts
    assert 4 <= r["facts_known"] <= facts
    assert r["items"] == 4
    assert r["erratum_tokens"] > 0 and r["document_tokens"] > 0
    assert [(x["arm"], x["strength"]) for x in r["rows"]] == [
        ("no_edit", None), ("reprefill", None), ("instruction_text", None), ("erratum", None),
        ("emphasize", 0), ("emphasize", 3), ("emphasize_profiled", 0), ("emphasize_profiled", 3),
        ("steer", 0), ("steer", 6)]
    assert r["steer_pairs"] == 4
    # The profiled heads: as many as asked, distinct, ranked by their gain.
    heads = r["profiled_heads"]
    assert len(heads) == 4 and len({(h["layer"], h["head"]) for h in heads}) == 4, heads
    assert [h["gain"] for h in heads] == sorted((h["gain"] for h in heads), reverse=True), heads
    rows = {x["arm"] + str(x["strength"] or ""): x for x in r["rows"]}
    for arm, x in rows.items():
        assert x["items"] == 4, x
        assert x["fluency_items"] == 1, x
        for key in ("efficacy", "paraphrase_efficacy", "specificity_top1"):
            assert 0 <= x[key]["lo"] <= x[key]["mean"] <= x[key]["hi"] <= 1, (arm, key, x[key])
        assert x["ttft_ms"]["mean"] > 0, x
        assert (x["edit_ms"]["mean"] > 0) == (arm == "erratum" or arm.startswith("steer")), x
    assert rows["no_edit"]["specificity_top1"]["mean"] == 1
    assert rows["no_edit"]["specificity_kl"]["mean"] == 0
    assert rows["reprefill"]["ttft_ms"]["mean"] == rows["reprefill"]["reprefill_ms"]["mean"]
    # Emphasis or steering of strength 0 is no edit: the unedited answers.
    for arm in ("emphasize", "emphasize_profiled", "steer"):
        for key in ("efficacy", "paraphrase_efficacy", "logodds_shift"):
            assert abs(rows[arm][key]["mean"] - rows["no_edit"][key]["mean"]) < 1e-3, (arm, key)
        assert rows[arm]["specificity_top1"]["mean"] == 1, arm
    # A steering of strength 6 moves the stored values, so the answers.
    assert rows["steer6.0"]["specificity_kl"]["mean"] > 0


def test_a_malformed_facts_file_is_refused_naming_its_line(tmp_path):
    bad = tmp_path / "facts.txt"
    bad.write_text("relation: r\nstatement: {s} is {o}.\nquestion: {s} is\nfact: no bar here\n")
    done = run(facts=bad)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "facts.txt:4" in done.stderr and "subject | object" in done.stderr, done.stderr
