"""Documents and CacheBlend through a 1 prefill + 1 decode deployment of the
tiny model (docs/serving.md, "Documents"): the `documents` field and the
separator, knowledge injection with progress, usage and /metrics figures,
and the rule that blended KV is never stored under prefix keys.
"""

import json
import math
import random
import uuid

import openai
import pytest

import subprocess
from pathlib import Path

from deploy_util import (Deployment, binary, metric, parse_metrics, repeat_cached, sse_events,
                         wait_until)
from test_api import engine_text, words_text


def fresh_docs(n, chars):
    """n documents no earlier request used, each ending in a newline."""
    rng = random.Random(uuid.uuid4().int)
    return [words_text(rng, chars + 16)[:chars - 1] + "\n" for _ in range(n)]


def details(usage):
    return usage.get("prompt_tokens_details") or {}


def inject(deployment, docs, stream=False, **fields):
    body = dict(documents=docs, stream=stream, **fields)
    if not stream:
        r = deployment.http.post("/v1/kdn/inject", json=body, timeout=120.0)
        assert r.status_code == 200, r.text[:500]
        return r.json(), []
    with deployment.http.stream("POST", "/v1/kdn/inject", json=body, timeout=120.0) as s:
        assert s.status_code == 200, s.read()[:500]
        assert s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]", events[-3:]
    parsed = [json.loads(e) for e in events[:-1]]
    return parsed[-1], parsed[:-1]


def test_inject_shows_progress_then_blend_reuses_the_documents(deployment):
    docs = fresh_docs(5, 120)
    final, progress = inject(deployment, docs, stream=True)
    # One progress event per document, in order, then the summary.
    assert [p["object"] for p in progress] == ["kdn.inject.progress"] * 5
    assert [p["done"] for p in progress] == [1, 2, 3, 4, 5]
    assert all(p["total"] == 5 for p in progress)
    assert final["object"] == "kdn.inject"
    assert (final["stored"], final["already_held"], final["failed"]) == (5, 0, 0), final
    assert final["tokens"] == 5 * 120 and final["errors"] == []
    again, _ = inject(deployment, docs)
    assert (again["stored"], again["already_held"]) == (0, 5), again

    before = parse_metrics(deployment.metrics())
    order = [3, 0, 4, 1, 2]
    question = "Question: which word comes first?\nAnswer:"
    r = deployment.completion(question, documents=[docs[i] for i in order], max_tokens=4,
                              temperature=0)
    d = details(r["usage"])
    assert r["usage"]["prompt_tokens"] == 1 + 5 * 120 + len(question)
    assert d["cached_tokens"] == d["blended_tokens"] == 600, r["usage"]
    assert d["recomputed_tokens"] == math.ceil(0.15 * 600), r["usage"]

    def grew(source):
        return (metric(parse_metrics(deployment.metrics()), "kdn_prompt_tokens_total",
                       source=source) - metric(before, "kdn_prompt_tokens_total", source=source))

    assert wait_until(lambda: grew("blended") == 600 - 90, 3), grew("blended")
    assert grew("recomputed") == 90
    assert grew("computed") == 1 + len(question)
    s = parse_metrics(deployment.metrics())
    assert metric(s, "kdn_injected_documents_total", result="stored") >= 5
    assert metric(s, "kdn_injected_documents_total", result="already_held") >= 5


def test_ratio_one_equals_the_full_prompt_before_and_after_caching(deployment):
    docs = fresh_docs(3, 200)
    question = "Z"
    want = engine_text(deployment.model, "".join(docs) + question, 16)
    for attempt in ("documents unseen", "documents held"):
        r = deployment.completion(question, documents=docs, max_tokens=16, temperature=0,
                                  recompute_ratio=1.0)
        assert r["choices"][0]["text"] == want, attempt
        d = details(r["usage"])
        if attempt == "documents unseen":
            assert d["blended_tokens"] == 0, r["usage"]
        else:
            assert d["blended_tokens"] == d["recomputed_tokens"] == 600, r["usage"]


def test_a_request_chooses_its_selection_policy(deployment):
    # boundary:K recomputes each held document's first K tokens (EPIC's),
    # whatever the ratio; K covering the documents is a full prefill.
    docs = fresh_docs(3, 200)
    question = "Z"
    inject(deployment, docs)
    want = engine_text(deployment.model, "".join(docs) + question, 16)
    r = deployment.completion(question, documents=docs, max_tokens=16, temperature=0,
                              blend_selection="boundary:4", recompute_ratio=0.5)
    d = details(r["usage"])
    assert d["blended_tokens"] == 600 and d["recomputed_tokens"] == 3 * 4, r["usage"]
    r = deployment.completion(question, documents=docs, max_tokens=16, temperature=0,
                              blend_selection="boundary:200")
    assert details(r["usage"])["recomputed_tokens"] == 600, r["usage"]
    assert r["choices"][0]["text"] == want
    # boundary+deviation keeps the ratio's share, boundary tokens among it.
    r = deployment.completion(question, documents=docs, max_tokens=4, temperature=0,
                              blend_selection="boundary+deviation:8", recompute_ratio=0.1)
    assert details(r["usage"])["recomputed_tokens"] == 60, r["usage"]


def blend_text(model, docs, question, max_tokens, selection, prune=None, errata=None,
               emphasis=None, extra=()):
    """kdn-generate's blend of the same prompt (documents computed on their
    own, pruned first when `prune` is {"method", "keep", "granularity"?, "scoring"?}, with an erratum
    after document i for each i: text of `errata`, fused as kdn-prefill
    does, greedy). `emphasis`: (phrases by document, strength, head profile
    file)."""
    cmd = [binary("kdn-generate"), "--model", str(model), "--prompt", question, "--max-tokens",
           str(max_tokens), "--threads", "1", "--blend-selection", selection] + [
               str(a) for a in extra]
    if prune:
        cmd += ["--prune-method", prune["method"], "--prune-keep", str(prune["keep"])]
        if "granularity" in prune:
            cmd += ["--prune-granularity", prune["granularity"]]
        if "scoring" in prune:
            cmd += ["--prune-scoring", prune["scoring"]]
    for i, note in (errata or {}).items():
        cmd += ["--erratum", "%d=%s" % (i, note)]
    if emphasis:
        phrases, strength, profile = emphasis
        for i, phrase in phrases.items():
            cmd += ["--emphasize", "%d=%s" % (i, phrase)]
        cmd += ["--emphasis-strength", str(strength), "--emphasis-heads", str(profile)]
    for d in docs:
        cmd += ["--document", d]
    r = subprocess.run(cmd, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout[:-1].decode("utf-8"), r.stderr.decode()


def test_a_blend_answers_as_kdn_generates_blend_of_the_same_selection(deployment):
    docs = fresh_docs(3, 120)
    question = "Question: which word comes first?\nAnswer:"
    inject(deployment, docs)
    for selection in ("boundary+deviation:8", "boundary:4", "deviation", "query",
                      "query+boundary:4"):
        r = deployment.completion(question, documents=docs, max_tokens=8, temperature=0,
                                  blend_selection=selection)
        d = details(r["usage"])
        want, log = blend_text(deployment.model, docs, question, 8, selection)
        assert "%d recomputed" % d["recomputed_tokens"] in log, (selection, d, log)
        # The query selections' pass over the question is reported beside it.
        passed = d.get("question_pass_tokens", 0)
        assert "%d in a question pass" % passed in log, (selection, d, log)
        assert (passed > 0) == selection.startswith("query"), (selection, d)
        assert d["blended_tokens"] == 360, r["usage"]
        assert r["choices"][0]["text"] == want, selection


QA_MODEL = Path(__file__).resolve().parents[2] / "models" / "kdn-qa"


@pytest.fixture(scope="module")
def qa_deployment(tmp_path_factory):
    """1 prefill and 1 decode worker serving the shipped kdn-qa, a trained
    model whose answers depend on where each token sits."""
    d = Deployment(tmp_path_factory.mktemp("run-qa"), QA_MODEL)
    try:
        yield d
    finally:
        d.down()


def test_an_erratum_edit_is_stored_apart_and_answers_as_kdn_generates_with_it(qa_deployment):
    d = qa_deployment
    # kdn-qa answers from its documents: the second says nothing of Gilpe's
    # job until its erratum does.
    docs = ["Vaigraik was born in Ferpis. Vaigraik works as a guard. Vaigraik is 23 years old. ",
            "Gilpe was born in Tobras. Gilpe is 50 years old. ",
            "Tobras is a town. The mayor of Tobras is Vaigraik. Tobras has 5410 people. "]
    note = "Gilpe works as a baker. "
    question = "Question: What is the job of Gilpe?\nAnswer:"
    selection = "boundary+deviation:8"
    tokens = sum(len(doc) for doc in docs)  # kdn-qa is byte-level

    def edit(**body):
        return d.http.post("/v1/kdn/edit", json=body, timeout=120.0)

    # The original not in the KDN: a 400 naming the document, nothing stored.
    r = edit(document=docs[1], erratum=note)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "document", r.text[:300]
    final, _ = inject(d, docs)
    assert final["stored"] == 3, final

    r = edit(document=docs[1], erratum=note)
    assert r.status_code == 200, r.text[:300]
    e = r.json()
    assert (e["object"], e["edit"], e["already_held"]) == ("kdn.edit", "erratum", False), e
    assert (e["document_tokens"], e["erratum_tokens"]) == (len(docs[1]), len(note)), e
    assert e["stored_tokens"] == len(docs[1]) + len(note), e
    assert edit(document=docs[1], erratum=note).json()["already_held"]

    # A request names the edited version; the erratum's KV comes from the KDN.
    edited = [docs[0], {"text": docs[1], "erratum": note}, docs[2]]
    r = d.completion(question, documents=edited, max_tokens=24, temperature=0,
                     blend_selection=selection)
    assert details(r["usage"])["blended_tokens"] == tokens + len(note), r["usage"]
    want, _ = blend_text(d.model, docs, question, 24, selection, errata={1: note})
    assert r["choices"][0]["text"] == want
    assert "baker" in want, want
    # The original is still there, under its own key, and answers without it.
    r = d.completion(question, documents=docs, max_tokens=24, temperature=0,
                     blend_selection=selection)
    assert details(r["usage"])["blended_tokens"] == tokens, r["usage"]
    plain, _ = blend_text(d.model, docs, question, 24, selection)
    assert r["choices"][0]["text"] == plain
    assert "baker" not in plain, plain


def test_an_emphasized_phrase_answers_as_kdn_generate_emphasizes_it(qa_deployment, tmp_path):
    d = qa_deployment
    # Two documents disagree on Gilpe's job; kdn-qa answers with the later
    # one's unless the first one's is emphasized.
    docs = ["Gilpe was born in Tobras. Gilpe works as a guard. Gilpe is 50 years old. ",
            "Vaigraik was born in Ferpis. Gilpe works as a baker. Vaigraik is 23 years old. "]
    question = "Question: What is the job of Gilpe?\nAnswer:"
    selection = "boundary+deviation:8"
    config = json.loads((QA_MODEL / "config.json").read_text())
    heads = [[layer, head] for layer in range(config["num_hidden_layers"])
             for head in range(config["num_attention_heads"])]
    profile = tmp_path / "heads.json"
    profile.write_text(json.dumps({"profiled_heads": [{"layer": l, "head": h} for l, h in heads]}))
    inject(d, docs)

    r = d.completion(question, documents=docs, max_tokens=24, temperature=0,
                     blend_selection=selection)
    plain, _ = blend_text(d.model, docs, question, 24, selection)
    assert r["choices"][0]["text"] == plain
    assert "baker" in plain, plain

    emphasized = [{"text": docs[0], "emphasize": "guard"}, docs[1]]
    r = d.completion(question, documents=emphasized, max_tokens=24, temperature=0,
                     blend_selection=selection, emphasis={"strength": 1, "heads": heads})
    # The same stored documents: emphasis changes no KV in the KDN.
    assert details(r["usage"])["blended_tokens"] == sum(len(doc) for doc in docs), r["usage"]
    want, _ = blend_text(d.model, docs, question, 24, selection,
                         emphasis=({0: "guard"}, 1, profile))
    assert r["choices"][0]["text"] == want
    assert "guard" in want, want

    # A phrase the document does not hold: a 400 naming it.
    r = d.http.post("/v1/completions", json={
        "prompt": question, "documents": [{"text": docs[0], "emphasize": "baker"}, docs[1]]})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "documents[0].emphasize", r.text[:300]


def qa_example(row):
    """kdn-qa's evaluation example `row`: its documents, its question as
    the model is asked it, and each document's tokens (kdn-qa is
    byte-level)."""
    example = [json.loads(line) for line in (QA_MODEL / "eval.jsonl").open()][row]
    docs = [doc + " " for doc in example["documents"]]
    return docs, "Question: %s\nAnswer:" % example["question"], [len(d.encode()) for d in docs]


@pytest.mark.parametrize("method,row", [("expected_attention", 0), ("kvzip", 1)])
def test_documents_injected_pruned_blend_as_kdn_generate_prunes_and_blends_them(qa_deployment,
                                                                                 method, row):
    # The decode worker gets fewer KV slots than prompt tokens and must go on
    # at the prompt's length: its answer is kdn-generate's, in one process.
    d = qa_deployment
    docs, question, tokens = qa_example(row)
    kept = [n // 2 for n in tokens]
    prune = {"method": method, "keep": 0.5, "granularity": "token"}
    before = parse_metrics(d.metrics())
    final, progress = inject(d, docs, stream=True, prune=prune)
    assert (final["stored"], final["failed"]) == (len(docs), 0), final
    assert final["tokens"] == sum(tokens)
    assert final["stored_tokens"] == sum(kept), final
    # One event per document done, each adding that document's kept tokens.
    # Documents finish in any order: a prefill worker computes first the
    # queued job whose KDN reads are done (docs/serving.md, "Inside a worker").
    done = [p["stored_tokens"] for p in progress]
    assert sorted(b - a for a, b in zip([0] + done, done)) == sorted(kept), (done, kept)
    r = d.completion(question, documents=docs, max_tokens=24, temperature=0,
                     blend_selection="boundary+deviation:8")
    u = details(r["usage"])
    pruned = sum(tokens) - sum(kept)
    assert u["blended_tokens"] == sum(tokens) and u["pruned_tokens"] == pruned, r["usage"]
    want, log = blend_text(d.model, docs, question, 24, "boundary+deviation:8", prune)
    assert "%d pruned" % pruned in log, log
    assert "%d recomputed" % u["recomputed_tokens"] in log, (u, log)
    assert r["choices"][0]["text"] == want
    s = parse_metrics(d.metrics())

    def grew(name):
        return metric(s, name) - metric(before, name)

    assert grew("kdn_injected_tokens_total") == sum(tokens)
    assert grew("kdn_injected_stored_tokens_total") == sum(kept)
    assert grew("kdn_prompt_pruned_tokens_total") == pruned
    # Injected again whole: the KDN holds the documents already (pruned).
    again, _ = inject(d, docs)
    assert (again["already_held"], again["stored_tokens"]) == (len(docs), 0), again


@pytest.mark.parametrize("method,granularity,scoring,row", [("expected_attention", "head", None, 2),
                                                            ("kvzip", None, None, 3),
                                                            ("kvzip", "global", "full", 4),
                                                            ("kvzip", None, "combined", 5)])
def test_documents_injected_pruned_per_head_blend_as_kdn_generate_does(qa_deployment, method,
                                                                       granularity, scoring, row):
    # Each layer's KV head kept tokens of its own: the chunk holds only
    # those, the blend gives a slot to each token some head kept, and the
    # decode worker gets the heads' holes with the KV. Its answer is
    # kdn-generate's, in one process. KVzip keeps globally unless told, by
    # its profiled scoring (the head budgets each measures on kdn's
    # calibration texts) unless told.
    d = qa_deployment
    docs, question, tokens = qa_example(row)
    prune = {"method": method, "keep": 0.5}
    if granularity:
        prune["granularity"] = granularity
    if scoring:
        prune["scoring"] = scoring
    before = parse_metrics(d.metrics())
    final, _ = inject(d, docs, prune=prune)
    assert (final["stored"], final["failed"]) == (len(docs), 0), final
    # Every head keeps half (head), or half on average (global): half of
    # each document's KV, in whole tokens.
    assert final["stored_tokens"] == sum(n // 2 for n in tokens), final
    r = d.completion(question, documents=docs, max_tokens=24, temperature=0,
                     blend_selection="boundary+deviation:8")
    u = details(r["usage"])
    # Some tokens no head kept; far fewer than half.
    assert u["blended_tokens"] == sum(tokens), r["usage"]
    assert u["pruned_tokens"] < sum(tokens) - sum(n // 2 for n in tokens), r["usage"]
    want, log = blend_text(d.model, docs, question, 24, "boundary+deviation:8", prune)
    assert "%d pruned" % u["pruned_tokens"] in log, (u, log)
    assert "%d recomputed" % u["recomputed_tokens"] in log, (u, log)
    assert r["choices"][0]["text"] == want
    s = parse_metrics(d.metrics())
    assert metric(s, "kdn_injected_stored_tokens_total") - metric(
        before, "kdn_injected_stored_tokens_total") == sum(n // 2 for n in tokens)


def test_a_quality_target_chooses_the_ratio_and_reports_it(deployment):
    docs = fresh_docs(3, 200)
    question = "Z"
    inject(deployment, docs)
    want = engine_text(deployment.model, "".join(docs) + question, 16)
    before = metric(parse_metrics(deployment.metrics()), "kdn_blend_recompute_ratio_count")
    # Met by nothing but recomputing every token: ratio 1, a full prefill.
    r = deployment.completion(question, documents=docs, max_tokens=16, temperature=0,
                              blend_max_kl=1e-9)
    d = details(r["usage"])
    assert d["recompute_ratio"] == 1 and d["recomputed_tokens"] == 600, r["usage"]
    assert r["choices"][0]["text"] == want
    # Met at once: the ladder's first ratio, 0.05.
    r = deployment.completion(question, documents=docs, max_tokens=4, temperature=0,
                              blend_max_kl=10)
    d = details(r["usage"])
    assert d["recompute_ratio"] == 0.05 and d["recomputed_tokens"] == 30, r["usage"]
    # A fixed ratio reports itself.
    r = deployment.completion(question, documents=docs, max_tokens=4, temperature=0,
                              recompute_ratio=0.2)
    assert details(r["usage"])["recompute_ratio"] == 0.2, r["usage"]
    s = parse_metrics(deployment.metrics())
    assert metric(s, "kdn_blend_recompute_ratio_count") == before + 3
    assert metric(s, "kdn_blend_recompute_ratio_bucket", le="0.05") >= 1


def test_blended_kv_is_never_stored_under_prefix_keys(deployment):
    docs = fresh_docs(3, 300)
    question = "Question: what now?\nAnswer:"
    inject(deployment, docs)
    r = deployment.completion(question, documents=docs, max_tokens=4, temperature=0,
                              recompute_ratio=0.0)
    assert details(r["usage"])["blended_tokens"] == 900
    assert details(r["usage"])["recomputed_tokens"] == 0
    # The same tokens as a plain prompt: no prefix chunk may come from the
    # blend (neither the prefill nor the decode worker stored one).
    # The prefill worker's path: its own exact chunks are what is asked of it.
    plain = deployment.completion("".join(docs) + question, max_tokens=4, temperature=0,
                                  disaggregation="always")
    assert details(plain["usage"])["cached_tokens"] == 0, plain["usage"]
    assert "blended_tokens" not in details(plain["usage"])
    # That plain request stored its own exact chunks.
    again = deployment.completion("".join(docs) + question, max_tokens=4, temperature=0,
                                  disaggregation="always")
    assert details(again["usage"])["cached_tokens"] == repeat_cached(
        again["usage"]["prompt_tokens"], 4)


def test_separator_and_chat_documents_through_the_openai_client(deployment):
    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="x", max_retries=0,
                           timeout=60.0)
    try:
        docs = fresh_docs(2, 100)
        inject(deployment, docs)
        prompt = " # # ".join(docs + ["Question: and then?"])
        c = client.completions.create(model=deployment.model_name, prompt=prompt, max_tokens=4,
                                      temperature=0, extra_body={"separator": " # # "})
        pd = c.usage.prompt_tokens_details
        assert c.usage.prompt_tokens == 1 + 200 + len("Question: and then?")
        assert pd.cached_tokens == 200
        assert pd.model_extra["blended_tokens"] == 200
        assert pd.model_extra["recomputed_tokens"] == 30

        chat = client.chat.completions.create(
            model=deployment.model_name, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "Question: and then?"}],
            extra_body={"documents": docs, "recompute_ratio": 0.05})
        pd = chat.usage.prompt_tokens_details
        assert pd.cached_tokens == 200
        # 0.05 of 200 is 10, under the default selection's boundary tokens:
        # the first 8 of each document (boundary+deviation:8).
        assert pd.model_extra["recomputed_tokens"] == 16
        assert chat.choices[0].message.role == "assistant"
    finally:
        client.close()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "q", "documents": "not a list"}, "documents"),
    ("/v1/completions", {"prompt": "q", "documents": ["a"], "recompute_ratio": 2}, "recompute_ratio"),
    ("/v1/completions", {"prompt": "q", "documents": ["a"], "check_layer": 5}, "check_layer"),
    ("/v1/completions", {"prompt": [1, 2], "documents": ["a"]}, "prompt"),
    ("/v1/completions", {"prompt": "q", "documents": ["a"], "blend_max_kl": 0}, "blend_max_kl"),
    ("/v1/completions", {"prompt": "q", "documents": ["a"], "blend_selection": "epic"},
     "blend_selection"),
    ("/v1/completions", {"prompt": "q", "documents": ["a"], "blend_selection": "boundary:0"},
     "blend_selection"),
    ("/v1/completions", {"prompt": "q", "documents": [{"text": "a", "erratum": ""}]},
     "documents[0].erratum"),
    ("/v1/completions", {"prompt": "q", "documents": [{"erratum": "x"}]}, "documents[0].text"),
    ("/v1/completions", {"prompt": "q", "documents": [{"text": "a", "note": "x"}]},
     "documents[0].note"),
    ("/v1/completions", {"prompt": "q", "documents": [{"text": "a", "emphasize": 3}]},
     "documents[0].emphasize"),
    ("/v1/completions", {"prompt": "q", "documents": ["a"], "emphasis": {"strength": 1}},
     "emphasis"),
    ("/v1/completions", {"prompt": "q", "documents": [{"text": "ab", "emphasize": "a"}],
                         "emphasis": {"strength": 100}}, "emphasis.strength"),
    ("/v1/completions", {"prompt": "q", "documents": [{"text": "ab", "emphasize": "a"}],
                         "emphasis": {"heads": [[99, 0]]}}, "emphasis.heads"),
    ("/v1/kdn/inject", {"documents": [{"text": "abcdefgh", "erratum": "x"}],
                        "prune": {"method": "knorm", "keep": 0.5}}, "prune"),
    ("/v1/kdn/edit", {"erratum": "x"}, "document"),
    ("/v1/kdn/edit", {"document": "abc"}, "erratum"),
    ("/v1/kdn/edit", {"document": "abc", "erratum": 3}, "erratum"),
    ("/v1/kdn/edit", {"document": "abc", "erratum": "x", "steer": {"vector": "v"}}, "steer"),
    ("/v1/kdn/edit", {"document": "x" * 2000, "erratum": "y" * 100}, "erratum"),
    ("/v1/kdn/edit", {"document": "abc", "steer": {"vector": "v", "strength": 0}},
     "steer.strength"),
    ("/v1/kdn/edit", {"document": "abc", "steer": {"vector": "v/w", "strength": 1}},
     "steer.vector"),
    ("/v1/completions", {"prompt": "q", "documents": [{"text": "a", "steer": {"vector": "v"}}]},
     "documents[0].steer.strength"),
    ("/v1/kdn/inject", {"documents": [{"text": "a", "steer": {"vector": "v", "strength": 1}}]},
     "documents[0].steer"),
    ("/v1/kdn/steering", {"name": "v", "pairs": [{"positive": "a"}]}, "pairs[0]"),
    ("/v1/kdn/steering", {"name": "v", "pairs": [{"positive": "a", "negative": "b"}],
                          "layers": [7]}, "layers"),
    ("/v1/kdn/steering", {"pairs": [{"positive": "a", "negative": "b"}]}, "name"),
    ("/v1/kdn/inject", {"documents": []}, "documents"),
    ("/v1/kdn/inject", {"documents": ["x" * 5000]}, "documents"),
    ("/v1/kdn/inject", {"documents": ["abcdefgh"], "prune": 0.5}, "prune"),
    ("/v1/kdn/inject", {"documents": ["abcdefgh"], "prune": {"method": "h2o", "keep": 0.5}},
     "prune.method"),
    ("/v1/kdn/inject", {"documents": ["abcdefgh"], "prune": {"method": "knorm"}}, "prune.keep"),
    ("/v1/kdn/inject",
     {"documents": ["abcdefgh"], "prune": {"method": "knorm", "keep": 0.5, "granularity": "row"}},
     "prune.granularity"),
    ("/v1/kdn/inject",
     {"documents": ["abcdefgh"], "prune": {"method": "kvzip", "keep": 0.5, "scoring": "fast"}},
     "prune.scoring"),
    # Profiled scoring chooses globally; a scoring is kvzip's alone.
    ("/v1/kdn/inject",
     {"documents": ["abcdefgh"],
      "prune": {"method": "kvzip", "keep": 0.5, "granularity": "token", "scoring": "profiled"}},
     "prune.scoring"),
    ("/v1/kdn/inject",
     {"documents": ["abcdefgh"], "prune": {"method": "knorm", "keep": 0.5, "scoring": "full"}},
     "prune.scoring"),
    ("/v1/kdn/inject",
     {"documents": ["abcdefgh"],
      "prune": {"method": "kvzip", "keep": 0.5, "granularity": "head", "scoring": "combined"}},
     "prune.scoring"),
    ("/v1/kdn/inject", {"documents": ["abcdefgh"], "prune": {"method": "knorm", "keep": 0}},
     "prune.keep"),
    ("/v1/kdn/inject",
     {"documents": ["abcdefgh"], "prune": {"method": "knorm", "keep": 0.5, "sinks": -2}},
     "prune.sinks"),
    ("/v1/kdn/inject",
     {"documents": ["abcdefgh"], "prune": {"method": "knorm", "keep": 0.5, "window": 4}}, "prune"),
    ("/v1/kdn/inject", {"documents": ["abc"], "prune": {"method": "knorm", "keep": 0.5}},
     "documents"),
    # Under the tiny model's context of 2,048, but not with KVzip's repeat pass.
    ("/v1/kdn/inject", {"documents": ["y" * 1100], "prune": {"method": "kvzip", "keep": 0.5}},
     "documents"),
])
def test_bad_blend_requests_get_a_400_naming_the_field(deployment, path, body, param):
    r = deployment.http.post(path, json=body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
