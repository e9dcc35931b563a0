"""`demo`: starts a deployment as `up` does, sends it sample requests
(streaming completions, chat turns that reuse cached KV, documents injected
and blended), prints what comes back, then stops it unless --keep."""

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from .local import dry_run, forget, start_deployment
from .plan import FALLBACK_MODEL
from .procs import stop_all
from .util import Failure, Interrupted

# What `demo` sends. DEMO_DOCUMENT is long enough (more than one 256-token
# chunk, even for a BPE tokenizer) that the second chat turn reuses its KV.
DEMO_PROMPT = "The key-value cache of a transformer is"
DEMO_DOCUMENT = (
    "kdn is a serving system for large language models. It splits the work "
    "of a request in two: a prefill worker computes the key-value cache of "
    "the prompt, and a decode worker generates the answer token by token "
    "with continuous batching. Between them, the key-value cache travels "
    "over a transport (NCCL, CUDA IPC or TCP) layer by layer, so that the "
    "decode worker can start while the prefill worker still computes the "
    "last layers. The prompt is cut into chunks of a fixed number of tokens; "
    "every chunk has a key derived from the model and from all the tokens "
    "before it and in it. Finished chunks are kept in a key-value data "
    "network: the host memory of each worker, then a shared store process, "
    "then disk. When a later request starts with the same text, for example "
    "the next turn of a conversation, or a question about the same long "
    "document, the prefill worker loads those chunks instead of computing "
    "them again, and only computes what is new. The router picks the prefill "
    "worker with the least work to do and the decode worker that already "
    "holds the conversation, tokenizes, streams the tokens back to the "
    "client and counts everything in its Prometheus metrics."
)
DEMO_QUESTIONS = ["What does the prefill worker do?", "Where are finished chunks kept?"]
DEMO_MAX_TOKENS = 32
QA_MAX_TOKENS = 96  # kdn-qa answers restate one or two facts: up to ~70 bytes
DEMO_TIMEOUT_S = 60.0  # per read: a stuck request fails the demo instead of hanging it


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
    """`text` with control characters escaped, so that noise from a random
    model cannot garble the terminal; newlines are kept unless the text is
    only whitespace (plain spaces, as a streamed byte-level token, print as
    they are)."""
    if text and not text.strip() and text.strip(" "):
        return json.dumps(text)
    return "".join(ch if ch in "\n\t" or ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def describe_usage(usage):
    if not usage:
        return "no usage reported"
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0)
    blend = ""
    if "blended_tokens" in details:
        blend = ": %d blended from the documents' cached KV, %d of them recomputed" % (
            details["blended_tokens"], details.get("recomputed_tokens", 0))
    return "prompt %d tokens (%d cached%s), completion %d tokens" % (
        usage.get("prompt_tokens", 0), cached, blend, usage.get("completion_tokens", 0))


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


def stream_completion(url, prompt, max_tokens, stop=None, documents=None):
    """Streams a /v1/completions request, printing text as it arrives; returns (text, usage)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if stop:
        body["stop"] = stop
    if documents:
        body["documents"] = documents
    text, usage = "", None
    with post(url + "/v1/completions", body) as r:
        for event in sse_events(r, "the stream"):
            for c in event.get("choices", []):
                piece = c.get("text", "")
                text += piece
                sys.stdout.write(printable(piece))
                sys.stdout.flush()
            usage = event.get("usage") or usage
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
        print("-- " + describe_usage(usage))


def demo_requests(url, model_is_random, model_dir):
    demo_file = Path(model_dir) / "demo.json"
    if demo_file.is_file():
        examples = json.loads(demo_file.read_text())
        if isinstance(examples, dict):
            examples = examples.get("examples", [])
        qa_demo_requests(url, examples)
        return
    if model_is_random:
        print("note: the default model has random weights, so its text is noise; the demo "
              "shows the serving path (streaming, chat, cached tokens), not answers.")
    print("\n== POST /v1/completions, streaming: %r" % DEMO_PROMPT)
    sys.stdout.write(DEMO_PROMPT)
    _, usage = stream_completion(url, DEMO_PROMPT, DEMO_MAX_TOKENS)
    print("\n-- " + describe_usage(usage))
    # Two turns about the same document: the second one finds the document's
    # chunks in the KDN (cached tokens).
    for q in DEMO_QUESTIONS:
        print("\n== POST /v1/chat/completions: a %d-character document, then %r"
              % (len(DEMO_DOCUMENT), q))
        with post(url + "/v1/chat/completions",
                  {"messages": [{"role": "system", "content": DEMO_DOCUMENT},
                                {"role": "user", "content": q}],
                   "max_tokens": DEMO_MAX_TOKENS, "temperature": 0}) as r:
            body = json.loads(r.read())
        print("assistant: " + printable(body["choices"][0]["message"]["content"]))
        print("-- " + describe_usage(body.get("usage")))
    # Documents stored ahead of time, then a question over them in another
    # order: their KV is blended in (CacheBlend), not recomputed.
    paragraphs = [p + "\n" for p in DEMO_DOCUMENT.split(". ") if p]
    print("\n== POST /v1/kdn/inject: %d documents" % len(paragraphs))
    summary = inject_documents(url, paragraphs)
    print("-- %d stored, %d already held, %d failed" % (
        summary["stored"], summary["already_held"], summary["failed"]))
    question = "Question: what moves between the workers?\nAnswer:"
    print("\n== POST /v1/completions, streaming: the %d documents in reverse order, then %r"
          % (len(paragraphs), question))
    _, usage = stream_completion(url, question, DEMO_MAX_TOKENS,
                                 documents=list(reversed(paragraphs)))
    print("\n-- " + describe_usage(usage))


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
