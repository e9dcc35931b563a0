"""The README's first command's demo, `kdn-launch demo` on SmolLM2-135M-Instruct
(what scripts/demo.sh runs after installing, building and fetching the
model), end to end: it exits 0, prints each exchange's KV sources and time to
first token and the `kdn-launch up` command; its transcript's answers are
kdn-generate's on the same requests (`--chat`, with `--document` for the
questions over documents: at ratio 1, a full prefill, where they were not
held yet), not fixed strings; later chat turns come from the KDN and the
reordered documents are blended.

Both run with weights widened to f32 and one thread, so that a prompt
computed in pieces (a cached prefix, then the rest) does the same arithmetic
as one computed whole; the native formats' arithmetic is checked against
llama.cpp's (tests/parity/test_llama_cpp_logits.py).
"""

import json
import subprocess
import sys
from pathlib import Path

from deploy_util import binary, launch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from gguf_micro import smollm2_path  # noqa: E402


def kdn_generate(model, exchange, work):
    """kdn-generate's answer to one request of the transcript."""
    req = exchange["request"]
    chat = work / ("chat-%d.json" % len(list(work.glob("chat-*.json"))))
    chat.write_text(json.dumps(req["messages"]))
    cmd = [binary("kdn-generate"), "--model", str(model), "--chat", str(chat), "--max-tokens",
           str(req["max_tokens"]), "--weights-dtype", "f32", "--threads", "1"]
    for d in req.get("documents", []):
        cmd += ["--document", d]
    if req.get("documents") and exchange["usage"]["prompt_tokens_details"]["blended_tokens"] == 0:
        cmd += ["--recompute-ratio", "1"]  # not held yet: the deployment computed them in full
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout[:-1]


def test_the_demo_answers_as_kdn_generate_does(tmp_path):
    model = smollm2_path()
    transcript = tmp_path / "transcript.json"
    r = launch("demo", "--port", 0, "--run-dir", tmp_path / "run", "--model", model,
               "--threads", 1, "--weights-dtype", "f32", "--transcript", transcript,
               timeout=600)
    assert r.returncode == 0, "stdout:\n%s\nstderr:\n%s" % (r.stdout[-3000:], r.stderr[-3000:])
    out = r.stdout
    lines = [l for l in out.splitlines() if l.startswith("-- prompt ")]
    assert len(lines) == 5 and all("; first token after " in l for l in lines), out
    assert "to keep such a deployment running: " in out and " up --model " in out, out
    exchanges = json.loads(transcript.read_text())
    assert len(exchanges) == 5, exchanges  # three chat turns, the documents asked twice
    chat, docs = exchanges[:3], exchanges[3:]

    # Turns 2 and 3 carry the conversation so far: most of it from the KDN.
    for prev, turn in zip(chat, chat[1:]):
        details = turn["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] >= prev["usage"]["prompt_tokens"] // 2, turn["usage"]
        assert turn["request"]["messages"][-2]["content"] == prev["answer"]
    # The documents, unseen, then reversed and held: blended.
    first, again = (e["usage"]["prompt_tokens_details"] for e in docs)
    assert first.get("blended_tokens", 0) == 0, first
    assert again["blended_tokens"] > 0 and 0 < again["recomputed_tokens"] < again["blended_tokens"]
    assert docs[1]["request"]["documents"] == list(reversed(docs[0]["request"]["documents"]))

    work = tmp_path / "generate"
    work.mkdir()
    for e in exchanges:
        assert e["answer"].strip(), e
        assert e["answer"] == kdn_generate(model, e, work), e["request"]


def test_kdn_generate_refuses_a_chat_file_it_cannot_use(tiny_model, tmp_path):
    def run(*args):
        return subprocess.run([binary("kdn-generate"), "--model", str(tiny_model),
                               "--max-tokens", "2", *args], capture_output=True, text=True,
                              timeout=120)

    bad = tmp_path / "chat.json"
    r = run("--chat", str(tmp_path / "missing.json"))
    assert r.returncode == 1 and "cannot read" in r.stderr, r.stderr
    for text, words in (("{}", "not a JSON array"), ("[", "not a JSON array"),
                        ('[{"role": "user"}]', '{"role": ..., "content": ...}'),
                        ('[{"role": "user", "content": 3}]', '{"role": ..., "content": ...}')):
        bad.write_text(text)
        r = run("--chat", str(bad))
        assert r.returncode == 2 and words in r.stderr, (text, r.stderr)
    bad.write_text('[{"role": "system", "content": "Be brief."}]')
    r = run("--chat", str(bad), "--document", "A document.")
    assert r.returncode == 2 and "has none" in r.stderr, r.stderr
    r = run("--chat", str(bad), "--prompt", "x")
    assert r.returncode != 0 and "excludes" in r.stderr, r.stderr
    bad.write_text('[{"role": "user", "content": "Hello"}]')
    r = run("--chat", str(bad))
    assert r.returncode == 0, r.stderr
