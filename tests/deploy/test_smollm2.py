"""A real pretrained model served end to end: SmolLM2-135M-Instruct as a Q4_1
GGUF file (scripts/fetch-smollm2.sh; KDN_SMOLLM2 names another copy), served
by `kdn-launch up --model FILE.gguf` with one prefill worker, one decode
worker and kdn-store, and checked against transformers through the official
`openai` client:

  - a multi-turn chat (a system message, three user turns, the model's own
    answers as the assistant turns), each turn non-streaming and then
    streaming, greedy: the text transformers' `generate` gives (fp32, eager
    attention) on a Hugging Face folder written from the same GGUF
    (tests/parity/test_gguf.py's hf_folder), on the prompt that
    `apply_chat_template` renders from the GGUF's chat template, tokenized by
    llama.cpp's own tokenizer; the prompt and completion token counts;
  - every later request's `cached_tokens`: exactly the KDN lookup of
    docs/kvbus.md ("Tail keys") over what the earlier requests stored (the
    prefill worker each prompt, the decode worker each conversation);
  - documents (docs/blend.md): unseen, they are computed in full and the
    answer is transformers'; held, they are blended (usage counts them as
    cached and blended, with the default share recomputed), and at ratio 1
    the answer is transformers' again;
  - on the weights as stored (Q4_1, a deployment of its own): each chat
    turn's answer is the same computed whole, served again from the KDN, and
    by kdn-generate alone (batch invariance, docs/engine.md).
"""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import gguf
import openai
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from deploy_util import BIN_DIR, CHUNK_TOKENS, MIN_TAIL_TOKENS, Deployment, _tail_pieces

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from gguf_micro import smollm2_path  # noqa: E402
from llama_cpp_tokenize import llama_cpp_decode, llama_cpp_ids  # noqa: E402
from test_gguf import hf_folder  # noqa: E402

EOS = 2  # <|im_end|>
NEW_TOKENS = 24
RECOMPUTE_RATIO = 0.15  # kdn-launch's default --recompute-ratio
BOUNDARY_TOKENS = 8  # kdn-router's default --blend-selection, boundary+deviation:8

SYSTEM = "You are a concise assistant. Answer every question in one short sentence."
# The second answer runs past NEW_TOKENS (finish_reason "length"); the others
# end with <|im_end|>.
QUESTIONS = ["What is the capital of France?",
             "Describe the city in detail.",
             "And what is the capital of Germany?"]
DOCUMENTS = ["The lighthouse of Varn was built in 1887 and is painted red and white.\n",
             "Its keeper, Anna Lind, lit the lamp every evening for thirty-one years.\n"]
DOC_QUESTION = "Who kept the lighthouse of Varn, and for how long?"


class Reference:
    """transformers on SmolLM2 (a folder written from the GGUF), with the
    GGUF's chat template and llama.cpp's tokenizer of the GGUF."""

    def __init__(self, gguf_path, folder):
        self.gguf = gguf_path
        reader = gguf.GGUFReader(str(gguf_path))
        fields = reader.fields
        self.template = fields["tokenizer.chat_template"].contents()
        tokens = fields["tokenizer.ggml.tokens"].contents()
        assert int(fields["tokenizer.ggml.eos_token_id"].contents()) == EOS
        # apply_chat_template needs a tokenizer; only its special tokens matter.
        self.tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
            bos_token=tokens[int(fields["tokenizer.ggml.bos_token_id"].contents())],
            eos_token=tokens[EOS], clean_up_tokenization_spaces=False)
        self.model = LlamaForCausalLM.from_pretrained(
            hf_folder(reader, folder), torch_dtype=torch.float32,
            attn_implementation="eager").eval()

    def render(self, messages):
        return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=True)

    def ids(self, texts):
        return llama_cpp_ids(self.gguf, texts, add_special=False, parse_special=True)

    def generate(self, prompt):
        """Greedy new tokens (with the <|im_end|> that ends them, if any) and
        their text."""
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]),
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=EOS, pad_token_id=EOS)
        new = out[0, len(prompt):].tolist()
        text = llama_cpp_decode(self.gguf, [new[:-1] if new[-1] == EOS else new])[0]
        return new, text


def expected_cached(prompt, stored, chunk=CHUNK_TOKENS):
    """cached_tokens of `prompt` when the KDN holds the token lists `stored`,
    each as its full chunks and its tail pieces, by docs/kvbus.md's lookup:
    at most all but the last token; the full chunks held, then the longest
    chain of stored tail pieces after them, probed largest first, if it
    covers MIN_TAIL_TOKENS. (deploy_util.repeat_cached is the case of one
    prompt sent twice.)"""
    limit = len(prompt) - 1
    full = 0
    while (full + 1) * chunk <= limit and any(
            len(s) >= (full + 1) * chunk and s[:(full + 1) * chunk] == prompt[:(full + 1) * chunk]
            for s in stored):
        full += 1
    first = full * chunk
    tails = [s for s in stored if len(s) // chunk == full and len(s) > first and
             s[:first] == prompt[:first]]

    def held(sizes):
        end = first + sum(sizes)
        return any(_tail_pieces(len(s) - first)[:len(sizes)] == sizes and
                   s[first:end] == prompt[first:end] for s in tails)

    path = []
    if limit > first and held([1]):
        path = [1]
        size = 1 << max(chunk - 2, 1).bit_length() - 1
        while size >= 1:
            if sum(path) + size <= min(limit - first, chunk - 1) and held(path + [size]):
                path.append(size)
            size >>= 1
    tail = sum(path)
    return first + (tail if tail >= MIN_TAIL_TOKENS else 0)


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_path()


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory):
    return Reference(smollm2, tmp_path_factory.mktemp("smollm2-hf"))


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    # Weights widened to f32: the arithmetic of the transformers reference
    # (fp32 on the dequantized tensors). The native quantized arithmetic is
    # checked against llama.cpp's (tests/parity/test_llama_cpp_logits.py).
    yield from serve(tmp_path_factory.mktemp("run-smollm2"), smollm2, "--weights-dtype", "f32")


def serve(run_dir, smollm2, *flags):
    """A SmolLM2 deployment with kdn-store (its `flags` added) and an openai
    client of it, for a fixture to yield; both closed after."""
    d = Deployment(run_dir, smollm2, "--store", "--store-host-mib", 64, *flags)
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120.0)
    try:
        yield d, client
    finally:
        client.close()
        d.down()


def chat(d, client, messages, stream, **extra):
    """(text, finish_reason, usage) of one greedy chat completion."""
    fields = dict(model=d.model_name, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    if extra:
        fields["extra_body"] = extra
    if not stream:
        r = client.chat.completions.create(**fields)
        assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **fields):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "no usage chunk in the stream"
    return text, finish, usage


def test_multi_turn_chat_equals_transformers_and_reuses_the_conversation(served, reference):
    d, client = served
    messages = [{"role": "system", "content": SYSTEM}]
    stored = []  # what the KDN holds: each prompt, and each conversation but its last token
    finishes = []
    settled = 0.0  # when what the last request stored has surely landed
    for turn, question in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": question})
        prompt = reference.ids([reference.render(messages)])[0]
        new, want = reference.generate(prompt)
        assert want.strip(), "turn %d: the reference generated no text" % turn
        finish_want = "stop" if new[-1] == EOS else "length"
        for stream in (False, True):
            what = "turn %d, %s" % (turn, "streaming" if stream else "not streaming")
            cached_want = expected_cached(prompt, stored)
            # The decode worker stores the conversation on its store I/O
            # thread once the last token is out; give that round trip time.
            time.sleep(max(0.0, settled - time.monotonic()))
            text, finish, usage = chat(d, client, messages, stream)
            settled = time.monotonic() + 1.0
            assert text == want, what
            assert finish == finish_want, what
            assert usage.prompt_tokens == len(prompt), (what, usage)
            assert usage.completion_tokens == len(new), (what, usage)
            assert usage.prompt_tokens_details.cached_tokens == cached_want, (what, usage)
            # A conversation sent again loads what its first request stored;
            # a later turn loads at least the whole conversation before it,
            # its last answer token aside (its KV was never computed).
            if stream:
                assert cached_want > 0, what
            elif turn > 1:
                assert cached_want >= len(stored[-1]), what
            stored += [prompt, prompt + new[:-1]]
        finishes.append(finish_want)
        messages.append({"role": "assistant", "content": want})
    assert "stop" in finishes and "length" in finishes, finishes


def test_documents_are_computed_then_blended(served, reference):
    d, client = served
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOC_QUESTION}]
    # The router tokenizes the template's opening, each document and the rest
    # on their own (docs/blend.md); the documents open the last user message.
    joined = "".join(DOCUMENTS)
    text = reference.render([messages[0], {"role": "user", "content": joined + DOC_QUESTION}])
    at = text.index(joined)
    pieces = reference.ids([text[:at]] + DOCUMENTS + [text[at + len(joined):]])
    prompt = [t for p in pieces for t in p]
    doc_tokens = sum(len(p) for p in pieces[1:-1])
    new, want = reference.generate(prompt)
    assert want.strip(), "the reference generated no text"

    def details(usage):
        pd = usage.prompt_tokens_details
        extra = pd.model_extra or {}
        return pd.cached_tokens, extra.get("blended_tokens"), extra.get("recomputed_tokens")

    # Unseen: computed in full (and stored on their own after the reply).
    text, _, usage = chat(d, client, messages, False, documents=DOCUMENTS)
    assert usage.prompt_tokens == len(prompt), usage
    assert details(usage) == (0, 0, 0), usage
    assert text == want
    assert usage.completion_tokens == len(new), usage

    # Held: blended, the default share recomputed, and at least each
    # document's first BOUNDARY_TOKENS (kdn-router's default selection,
    # boundary+deviation:8).
    text, finish, usage = chat(d, client, messages, True, documents=DOCUMENTS)
    assert usage.prompt_tokens == len(prompt), usage
    boundary = sum(min(BOUNDARY_TOKENS, len(p)) for p in pieces[1:-1])
    assert details(usage) == (doc_tokens, doc_tokens,
                              max(math.ceil(RECOMPUTE_RATIO * doc_tokens), boundary)), usage
    assert text.strip() and finish in ("stop", "length"), (text, finish)

    # Held, every document token recomputed: a full prefill again.
    text, _, usage = chat(d, client, messages, False, documents=DOCUMENTS, recompute_ratio=1.0)
    assert details(usage) == (doc_tokens, doc_tokens, doc_tokens), usage
    assert text == want


@pytest.fixture(scope="module")
def served_native(smollm2, tmp_path_factory):
    # The weights as the GGUF stores them (Q4_1; the default): 8-bit
    # activations, batch-invariant products (docs/engine.md, "Batch
    # invariance").
    yield from serve(tmp_path_factory.mktemp("run-smollm2-native"), smollm2)


def test_native_weights_answer_a_chat_alike_from_the_kdn_and_as_kdn_generate(served_native, smollm2,
                                                                            tmp_path):
    """On native weights each turn's greedy answer is the same computed whole
    (its first request), from the KDN (the same chat again: its prompt's
    KV loaded, the rest computed in another batch shape) and by kdn-generate
    alone on the same conversation."""
    d, client = served_native
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": question})
        first, _, u1 = chat(d, client, messages, stream=False)
        # The prefill worker stores the prompt's KV after its reply; give
        # that round trip time, as the f32 test does.
        time.sleep(1.0)
        again, _, u2 = chat(d, client, messages, stream=True)
        assert u2.prompt_tokens_details.cached_tokens > u1.prompt_tokens_details.cached_tokens, \
            (turn, u1, u2)
        assert again == first, "turn %d: the repeat, served from the KDN, differs" % turn
        conversation = tmp_path / ("turn%d.json" % turn)
        conversation.write_text(json.dumps(messages))
        r = subprocess.run([str(BIN_DIR / "kdn-generate"), "--model", str(smollm2), "--chat",
                            str(conversation), "--max-tokens", str(NEW_TOKENS), "--threads", "1"],
                           capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        assert first == r.stdout.decode("utf-8", errors="replace")[:-1], \
            "turn %d: the deployment differs from kdn-generate" % turn
        messages.append({"role": "assistant", "content": first})
