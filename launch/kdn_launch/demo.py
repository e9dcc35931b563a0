"""`demo`: starts a deployment as `up` does, sends it sample requests
(streaming completions, chat turns that reuse cached KV, documents injected
and blended), prints what comes back, then stops it unless --keep."""

import json
import os
import re
import shlex
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .local import dry_run, forget, start_deployment
from .plan import FALLBACK_MODEL
from .procs import stop_all
from .util import Failure, Interrupted

# What `demo` sends to a chat model (SmolLM2-135M-Instruct in
# scripts/demo.sh): real text from Debian's base-files (licence texts are
# shipped to be copied verbatim), so that nothing of it is the project's own
# prose and it is on every Debian machine.
LICENSE = Path("/usr/share/common-licenses/Apache-2.0")
CHAT_SECTION = 4  # the conversation's document: "Redistribution"
CHAT_QUESTIONS = ["What must I give the recipients when I redistribute the Work?",
                  "And what must modified files carry?",
                  "Can I add my own copyright statement to my modifications?"]
DOC_SECTIONS = [2, 3, 7]  # copyright licence, patent licence, disclaimer of warranty
DOC_QUESTION = "Which of these sections says the Work is provided without warranties?"
CHAT_MAX_TOKENS = 48
QA_MAX_TOKENS = 96  # kdn-qa answers restate one or two facts: up to ~70 bytes
DEMO_TIMEOUT_S = 120.0  # per read: a stuck request fails the demo instead of hanging it


# With --api-keys the demo asks as the key file's first key (its tenant).
DEMO_API_KEY = None


def first_api_key(path):
    """The first key of a kdn-router key file ("KEY TENANT" lines)."""
    for line in Path(path).read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#"):
            return fields[0]
    return None


def post(url, body, timeout=DEMO_TIMEOUT_S):
    headers = {"Content-Type": "application/json"}
    if DEMO_API_KEY:
        headers["Authorization"] = "Bearer " + DEMO_API_KEY
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(req, timeout=timeout)


def printable(text):
    """`text` with control characters other than newline and tab escaped, so
    that noise from a random model cannot garble the terminal."""
    return "".join(ch if ch in "\n\t" or ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def sse_events(response, what):
    """The JSON events of a server-sent event stream, up to `data: [DONE]`;
    an error event raises Failure naming `what`."""
    for raw in response:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise Failure("%s failed: %s" % (what, event["error"].get("message")))
        yield event


def inject_documents(url, documents):
    """POST /v1/kdn/inject, streaming: prints progress; returns the summary."""
    summary = None
    with post(url + "/v1/kdn/inject", {"documents": documents, "stream": True}) as r:
        for event in sse_events(r, "injection"):
            if event.get("object") == "kdn.inject.progress":
                # One line rewritten on a terminal, one line per document in a log.
                end = "" if sys.stdout.isatty() else "\n"
                sys.stdout.write("%s   %d/%d documents done%s" % (
                    "\r" if end == "" else "", event["done"], event["total"], end))
                sys.stdout.flush()
            else:
                summary = event
    if sys.stdout.isatty():
        print()
    return summary


def qa_prompt(documents, question):
    """The prompt format models/kdn-qa was trained on (tools/train/corpus.py)."""
    return "".join(d + "\n" for d in documents) + "Question: " + question + "\nAnswer:"


# What the demo sent and got, in order, for --transcript: each exchange's
# route, messages or prompt, documents, max_tokens, answer, usage and time
# to first token.
TRANSCRIPT = []


def stream(url, route, body, show):
    """Streams one greedy request, printing its text as it arrives; returns
    (text, usage, seconds to the first text) and notes it in TRANSCRIPT."""
    body = dict(body, temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage, ttft = "", None, None
    t0 = time.monotonic()
    with post(url + route, body) as r:
        for event in sse_events(r, "the stream"):
            for c in event.get("choices", []):
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text += piece
                if show:
                    sys.stdout.write(printable(piece))
                    sys.stdout.flush()
            usage = event.get("usage") or usage
    TRANSCRIPT.append({"route": route, "request": {k: v for k, v in body.items()
                                                   if k not in ("stream", "stream_options")},
                       "answer": text, "usage": usage, "ttft_s": ttft})
    return text, usage, ttft if ttft is not None else time.monotonic() - t0


def stream_completion(url, prompt, max_tokens, stop=None, documents=None):
    """Streams a /v1/completions request, printing text as it arrives; returns (text, usage)."""
    body = {"prompt": prompt, "max_tokens": max_tokens}
    if stop:
        body["stop"] = stop
    if documents:
        body["documents"] = documents
    text, usage, _ = stream(url, "/v1/completions", body, show=True)
    return text, usage


def qa_demo_requests(url, examples):
    """Questions about documents to the trained model, sent as `documents`,
    then the first example again with its documents in reverse order: their
    KV, cached on its own by the first request, is blended in."""
    runs = [(e["documents"], e["question"], e.get("answer"), "") for e in examples]
    if examples:
        e = examples[0]
        runs.append((list(reversed(e["documents"])), e["question"], e.get("answer"),
                     " (again, documents reversed: their KV now comes from the KDN)"))
    for documents, question, answer, note in runs:
        print("\n== POST /v1/completions, streaming: %d documents, then %r%s"
              % (len(documents), question, note))
        for d in documents:
            print("   | " + d)
        sys.stdout.write("answer:")
        text, usage = stream_completion(url, qa_prompt([], question), QA_MAX_TOKENS,
                                        stop=["\n"], documents=[d + "\n" for d in documents])
        print()
        if answer is not None:
            print("-- expected %r: %s" % (answer, "right" if text.strip() == answer else "wrong"))
        print("-- " + prompt_sources(usage))


def license_sections(numbers):
    """The numbered sections of the Apache License 2.0 text that Debian's
    base-files installs, each on one line."""
    text = LICENSE.read_text()
    out = []
    for n in numbers:
        m = re.search(r"^ +%d\. (.*?)(?=^ +%d\. |^ +END OF TERMS)" % (n, n + 1), text,
                      re.S | re.M)
        if not m:
            raise Failure("no section %d in %s" % (n, LICENSE))
        out.append(" ".join(m.group(1).split()))
    return out


def ms(seconds):
    return "%.0f ms" % (1e3 * seconds)


def prompt_sources(usage):
    """How a prompt's tokens got their KV, from the usage the router reports."""
    if not usage:
        return "no usage reported"
    d = usage.get("prompt_tokens_details") or {}
    total, cached = usage.get("prompt_tokens", 0), d.get("cached_tokens", 0)
    if "blended_tokens" in d and d["blended_tokens"] == 0:
        return ("prompt %d tokens, all computed: the documents were not in the KDN yet (each "
                "is stored on its own now, for any later prompt that holds it)" % total)
    if "blended_tokens" in d:
        blended, recomputed = d["blended_tokens"], d.get("recomputed_tokens", 0)
        return ("prompt %d tokens: the documents' %d tokens blended from their KV in the KDN, "
                "%d of them recomputed (%.0f%%); %d tokens computed in full"
                % (total, blended, recomputed, 100.0 * recomputed / max(blended, 1),
                   total - blended))
    return "prompt %d tokens: %d with KV from the KDN (cached), %d computed" % (
        total, cached, total - cached)


def chat_demo_requests(url):
    """A conversation whose later turns find their prefix in the KDN, then
    one question over three documents asked twice, the documents reordered
    the second time: their KV, stored on its own by the first asking, is
    blended (CacheBlend) instead of recomputed."""
    (section,) = license_sections([CHAT_SECTION])
    messages = [{"role": "system",
                 "content": "You are a helpful assistant. Answer in one or two sentences, from "
                            "this text of the Apache License 2.0: " + section}]
    print("\n== 1. A conversation: a system message holding section %d of the Apache License "
          "2.0 (%d characters, from %s), then %d questions, each turn sent with the whole "
          "conversation so far (POST /v1/chat/completions, streaming)"
          % (CHAT_SECTION, len(section), LICENSE, len(CHAT_QUESTIONS)))
    first_ttft = None
    for turn, q in enumerate(CHAT_QUESTIONS, 1):
        messages.append({"role": "user", "content": q})
        print("\nturn %d, user: %s" % (turn, q))
        sys.stdout.write("assistant: ")
        text, usage, ttft = stream(url, "/v1/chat/completions",
                                   {"messages": list(messages), "max_tokens": CHAT_MAX_TOKENS},
                                   show=True)
        messages.append({"role": "assistant", "content": text})
        first_ttft = first_ttft or ttft
        note = "" if turn == 1 else " (turn 1: %s)" % ms(first_ttft)
        print("\n-- %s; first token after %s%s" % (prompt_sources(usage), ms(ttft), note))

    documents = license_sections(DOC_SECTIONS)
    print("\n== 2. Questions over documents: sections %s of the same licence sent as "
          "`documents`, then the question; the same again with the documents in reverse "
          "order" % ", ".join(map(str, DOC_SECTIONS)))
    for n, d in zip(DOC_SECTIONS, documents):
        print("   | %d. %s" % (n, d[:100] + "..."))
    ttfts = []
    for order, docs in (("in order", documents), ("reversed", list(reversed(documents)))):
        if ttfts:
            # The documents' own KV is stored after the first answer; an
            # injection of them waits for it and says they are held.
            print("\n== POST /v1/kdn/inject, the same documents")
            summary = inject_documents(url, [d + "\n" for d in documents])
            print("-- %d already held in the KDN, %d stored now, %d failed" % (
                summary["already_held"], summary["stored"], summary["failed"]))
        print("\nuser (documents %s): %s" % (order, DOC_QUESTION))
        sys.stdout.write("assistant: ")
        _, usage, ttft = stream(url, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": DOC_QUESTION}],
                                 "documents": [d + "\n" for d in docs],
                                 "max_tokens": CHAT_MAX_TOKENS}, show=True)
        ttfts.append(ttft)
        print("\n-- %s; first token after %s" % (prompt_sources(usage), ms(ttft)))
    print("-- blending instead of recomputing the reordered documents: first token after %s "
          "instead of %s (%s saved)" % (ms(ttfts[1]), ms(ttfts[0]), ms(ttfts[0] - ttfts[1])))


def demo_requests(url, model_is_random, model_dir):
    demo_file = Path(model_dir) / "demo.json"
    if demo_file.is_file():
        examples = json.loads(demo_file.read_text())
        if isinstance(examples, dict):
            examples = examples.get("examples", [])
        qa_demo_requests(url, examples)
        return
    if model_is_random:
        print("note: this model has random weights, so its text is noise; the demo shows the "
              "serving path (streaming, chat, cached and blended tokens), not answers. "
              "scripts/demo.sh runs it on SmolLM2-135M-Instruct.")
    chat_demo_requests(url)


def cmd_demo(args):
    global DEMO_API_KEY
    if args.dry_run:
        return dry_run(args)
    if args.api_keys:
        DEMO_API_KEY = first_api_key(args.api_keys)
    args.detach = False
    d, guard = start_deployment(args)
    d.save(os.getpid())
    print("kdn: serving on %s" % d.url, flush=True)
    failed = None
    try:
        demo_requests(d.url, Path(d.model) == FALLBACK_MODEL, d.model)
    except Interrupted:
        failed = "interrupted"
        args.keep = False
    except (urllib.error.URLError, OSError, ValueError, KeyError, Failure) as e:
        if isinstance(e, urllib.error.HTTPError):
            e = "%s %s" % (e.code, e.read().decode(errors="replace").strip())
        failed = "a demo request failed: %s" % e
    guard.armed = False
    if args.transcript:
        Path(args.transcript).write_text(json.dumps(TRANSCRIPT, indent=1) + "\n")
    if failed is None:
        print("\nto keep such a deployment running: %s up --model %s (its status page is at "
              "its URL's /)" % (shlex.quote(sys.argv[0]), shlex.quote(str(d.model))))
    if args.keep and failed is None:
        d.save(None)
        print("\nthe deployment keeps running on %s; stop it with: kdn-launch down" % d.url)
        return 0
    print()
    stop_all(d.procs)
    forget(d.run_dir)
    if failed:
        raise Failure(failed)
    return 0
