"""kdn's Jinja chat templates against transformers' apply_chat_template.

Real chat templates (llama.cpp's copies of the Hugging Face ones, and the
Qwen2 template in ggml-vocab-qwen2.gguf's metadata) are rendered by
transformers (tokenize=False) and by kdn (kdn_chat_template, the router's
ChatTemplate), over conversations that exercise them: one user message, a
system message, several turns, no generation prompt, Unicode, braces and
quotes that look like Jinja, whitespace that templates trim. They must give
the same text, or fail with the same raise_exception message.

The reference is transformers 4.44.2 with what later versions added to its
Jinja environment (the loopcontrols extension, strftime_now), which kdn has
too: Llama 3.2's and Mistral Small 3.2's templates print today's date with it.
Snippets of Jinja are compared with jinja2 itself in that environment.
"""
import json
import os
import subprocess
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from llama_cpp_ref import ref_dir

BIN = Path(os.environ.get("KDN_BIN_DIR", "build/bin"))


class NewerTransformersEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers 4.44.2's environment plus what 4.47 added to it."""

    def __init__(self, **kwargs):
        kwargs["extensions"] = list(kwargs.get("extensions", [])) + [jinja2.ext.loopcontrols]
        super().__init__(**kwargs)
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


@pytest.fixture(scope="module", autouse=True)
def newer_environment():
    # transformers imports the class when it compiles a template.
    saved = jinja2.sandbox.ImmutableSandboxedEnvironment
    jinja2.sandbox.ImmutableSandboxedEnvironment = NewerTransformersEnvironment
    yield
    jinja2.sandbox.ImmutableSandboxedEnvironment = saved


def gguf_template(name):
    import gguf

    reader = gguf.GGUFReader(str(ref_dir() / f"ggml-vocab-{name}.gguf"))
    field = reader.fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


# (template, bos_token, eos_token) as each model's tokenizer_config.json has them.
LLAMA3 = ("<|begin_of_text|>", "<|eot_id|>")
TEMPLATES = {
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", *LLAMA3),
    "llama-3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", *LLAMA3),
    "llama-3.3": ("meta-llama-Llama-3.3-70B-Instruct.jinja", *LLAMA3),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", None, "<|im_end|>"),
    "qwen2-gguf": ("gguf:qwen2", None, "<|im_end|>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>"),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "<s>", "</s>"),
    "deepseek-r1-llama": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
                          "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek-r1-qwen": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                         "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
USER2 = {"role": "user", "content": "And of Italy?"}
CONVERSATIONS = {
    "single_user": [USER],
    "system_user": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, ASSISTANT, USER2],
    "multi_turn_no_system": [USER, ASSISTANT, USER2],
    "ends_with_assistant": [USER, ASSISTANT],
    "unicode": [{"role": "user", "content": "Grüße, 世界! 🎉 — ½ café\u00a0ok\u2028x"}],
    "braces_and_quotes": [{"role": "user", "content":
                           "{{ not a tag }} {% if %} {# no #} \"double\" 'single' \\n \\ <s> </s>"}],
    "whitespace": [{"role": "system", "content": "\n  sys  \n"},
                   {"role": "user", "content": "  padded \t\n\n"}],
    "think": [USER, {"role": "assistant", "content": "<think>hmm</think>Paris."}, USER2],
    # Mistral's templates refuse these; the others render them.
    "two_users": [USER, USER2],
    "assistant_first": [ASSISTANT, USER],
}


def template_text(source):
    if source.startswith("gguf:"):
        return gguf_template(source[len("gguf:"):])
    return (ref_dir() / "templates" / source).read_text()


def reference(template, bos, eos, messages, add_generation_prompt):
    model = WordLevel({"<unk>": 0}, unk_token="<unk>")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), bos_token=bos, eos_token=eos,
                                  clean_up_tokenization_spaces=False)
    try:
        return {"text": tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)}
    except jinja2.TemplateError as e:
        return {"message": str(e)}


def kdn(cases):
    out = subprocess.run([str(BIN / "kdn_chat_template")], input=json.dumps(cases),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_real_templates_render_as_transformers_renders_them(name):
    source, bos, eos = TEMPLATES[name]
    template = template_text(source)
    cases, expected = [], []
    for conv_name, messages in CONVERSATIONS.items():
        for agp in (True, False):
            cases.append({"template": template, "messages": messages, "bos_token": bos,
                          "eos_token": eos, "add_generation_prompt": agp})
            expected.append((conv_name, agp, reference(template, bos, eos, messages, agp)))
    refused = 0
    for got, (conv_name, agp, want) in zip(kdn(cases), expected):
        where = f"{name}, {conv_name}, add_generation_prompt={agp}"
        if "message" in want:
            refused += 1
            assert got.get("error") == "INVALID_ARGUMENT", f"{where}: {got}"
            assert got["message"] == want["message"], where
        else:
            assert "text" in got, f"{where}: {got}"
            assert got["text"] == want["text"], where
            assert got["end_of_turn"] == (eos or ""), where
    if name.startswith("mistral"):
        # Both conversations whose roles do not alternate, with and without
        # the generation prompt.
        assert refused == 4


def test_the_date_of_llama_3_2_is_today():
    """strftime_now is there, as in newer transformers, not 4.44.2's fallback."""
    template = template_text(TEMPLATES["llama-3.2"][0])
    [got] = kdn([{"template": template, "messages": [USER], "bos_token": LLAMA3[0],
                  "eos_token": LLAMA3[1]}])
    assert "Today Date: " + datetime.now().strftime("%d %b %Y") in got["text"]


# Jinja itself: each snippet rendered by jinja2 in transformers' environment
# and by kdn's interpreter with the same variables.
VARIABLES = {
    "d": {"b": 1, "a": [1, {"c": "x"}], "items": 2},
    "s": "héllo wörld",
    "l": [3, 1, 2],
    "n": None,
    "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "bye"}],
    "f": 2.5,
}
SNIPPETS = [
    "{{ s[1:4] }}|{{ s[::-1] }}|{{ s[-3:] }}|{{ s|length }}|{{ l[::2] }}|{{ l[-1] }}",
    "{{ 1.5 + 1 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 2 ** 10 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 0.1 + 0.2 }}",
    "{{ 1e16 }} {{ 1e-5 }} {{ 0.0001 }} {{ 123456789.125 }} {{ 3.0 }} {{ -0.5 }}",
    "{{ 'a' ~ 1 ~ none ~ true ~ x }}|{{ [1, 'a', none, true, 2.0] }}|{{ ('a',) }}|{{ {'k': (1, 2)} }}",
    "{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ s|tojson }}|{{ 'é\"\\n\\u0001'|tojson(ensure_ascii=true) }}",
    "{{ d|tojson(sort_keys=true) }}|{{ d|tojson(separators=(',', ':')) }}|{{ [] | tojson(indent=2) }}",
    "{{ d.b }} {{ d['a'][1].c }} {{ d.a.1.c }} {{ d.zz is defined }} {{ d.items is defined }} {{ d['items'] }}",
    "{% for m in msgs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}"
    "{{ loop.length }}{{ loop.previtem.role if loop.previtem is defined }}{{ loop.cycle('a', 'b') }};{% endfor %}",
    "{% for m in msgs if m.role == 'user' %}{{ loop.index }}:{{ m.content }}{% if not loop.last %},{% endif %}"
    "{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{% for k in d %}{{ k }}{% endfor %}",
    "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 4 %}{% break %}{% endif %}"
    "{{ i }}{% endfor %}",
    "{% set ns = namespace(found=false, n=0) %}{% for m in msgs %}{% set ns.n = ns.n + 1 %}"
    "{% if m.role == 'assistant' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.found }} {{ ns.n }}",
    "{% set x = 1 %}{% for i in l %}{% set x = i %}{% endfor %}{{ x }}",
    "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t %}  block {{ a }}  {% endset %}[{{ t }}]"
    "{% set u | trim | upper %}  up  {% endset %}[{{ u }}]",
    "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}"
    "{{ greet('x') }} {{ greet('y', punct='?') }} {{ greet() }}",
    "{{ 'a' if n else 'b' }}{{ 'c' if l }}{{ 'd' if n }}|{{ n or 'e' }}{{ l and 'f' }}{{ not n }}",
    "{{ 1 < 2 < 3 }} {{ 'ab' in 'cabd' }} {{ 2 in l }} {{ 'a' in d }} {{ 5 not in l }} {{ [1, 2] == [1, 2] }} "
    "{{ true == 1 }} {{ 'a' < 'b' }} {{ (1, 2) < (1, 3) }}",
    "{{ x is defined }} {{ x is undefined }} {{ n is none }} {{ s is string }} {{ d is mapping }} "
    "{{ l is iterable }} {{ s is sequence }} {{ 1 is number }} {{ f is float }} {{ true is boolean }} "
    "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 'a' is eq 'a' }} {{ n is not none }} "
    "{{ l is sameas l }} {{ 'ab' is lower }} {{ x is mapping }} {{ 1 is true }} {{ false is false }}",
    "{{ '  a b  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ s|upper }}|{{ 'AbC'|lower }}|{{ 'hello woRLD'|title }}"
    "|{{ 'hELLO'|capitalize }}|{{ 'aaa'|replace('a', 'b', 2) }}|{{ l|join(', ') }}|{{ msgs|map(attribute='role')|join }}",
    "{{ l|first }} {{ l|last }} {{ l|length }} {{ l|count }} {{ l|sort }} {{ l|sort(reverse=true) }} "
    "{{ l|min }} {{ l|max }} {{ l|sum }} {{ l|reverse|list }} {{ 'abc'|list }} {{ [1, 1, 2]|unique|list }}",
    "{{ msgs|selectattr('role', 'equalto', 'user')|list|length }} {{ msgs|rejectattr('role', 'eq', 'user')|list }} "
    "{{ [0, 1, 2]|select|list }} {{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2]|reject('even')|list }}",
    "{{ x|default('dflt') }} {{ n|default('dflt') }} {{ ''|default('dflt', true) }} {{ x|d(3) }} {{ x|length }}",
    "{{ '3.7'|int }} {{ 'x'|int(5) }} {{ '1e3'|float }} {{ true|int }} {{ 2|float }} {{ f|int }} {{ '0x1A'|int(0, 16) }}",
    "{{ f|round }} {{ 3.14159|round(2) }} {{ 3|round }} {{ -2.5|round(0, 'floor') }} {{ 3.5|round }} {{ -3|abs }} {{ -f|abs }}",
    "{{ d|items|list }} {{ d|dictsort }} {{ d|dictsort(reverse=true) }} {{ x|items|list }} {{ 5|string }} {{ n|string }}",
    "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb\\n'|indent(2, blank=true) }}|",
    "{{ '  x y  '.strip() }}|{{ 'xyx'.strip('x') }}|{{ '  x'.lstrip() }}|{{ 'x  '.rstrip() }}|{{ 'a,b,,c'.split(',') }}"
    "|{{ ' a  b '.split() }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ 'a\\nb\\r\\nc'.splitlines() }}",
    "{{ s.startswith('hé') }} {{ s.endswith(('x', 'ld')) }} {{ s.find('w') }} {{ s.find('q') }} {{ s.count('l') }} "
    "{{ s.replace('l', 'L') }} {{ s.upper() }} {{ 'x y'.title() }} {{ '{} and {x}'.format(1, x='y') }} {{ '{0}{1}{0}'.format('a', 'b') }} "
    "{{ '-'.join(['a', 'b']) }} {{ '12'.isdigit() }} {{ 'ab'.isalpha() }}",
    "{{ d.get('zz') }} {{ d.get('zz', 5) }} {{ d.get('b') }} {{ d.keys()|list }} {{ d.values()|list }}",
    "{{ [1, 2] + [3] }} {{ 'ab' * 3 }} {{ [0] * 2 }} {{ -l[0] }} {{ +f }} {{ 10 - 2 * 3 }} {{ (10 - 2) * 3 }} {{ 2 ** 3 ** 2 }}",
    "{{ \"it's\" }} {{ 'say \"hi\"' }} {{ 'a' 'b' }} {{ '\\u00e9\\x41\\t|' }} {{ [\"it's\", 'x\\ny'] }}",
    "{{ 'a' + 'b'|upper }}{{ l|length + 1 }}{{ -f|abs }}",
    # Filters and tests some environments lack, used where jinja2 allows it.
    "{% if false %}{{ x|from_json }}{{ 1 is bogus }}{% endif %}{{ x|from_json if false else 1 }}",
    "{{ n|selectattr('a')|list }}{{ n|map(attribute='a')|list }}{{ 0|select|list }}",
]
# Whitespace control: trim_blocks and lstrip_blocks as transformers sets
# them, and the - and + markers.
WHITESPACE_SNIPPETS = [
    "  {% if true %}\n  x\n  {% endif %}\ny",
    "a  {%- if true -%}  b  {%- endif -%}  c",
    "{% for i in l %}\n    {{ i }}\n{% endfor %}\n",
    "x {{- ' y ' -}} z\n{{ 1 }}\n\n",
    "  {%+ if true %}a{% endif +%}\nb",
    "line\n  {# comment #}\n  {#- c2 -#}  after\n{# c3 #}end",
    "{% if true %}  \n{% endif %}|\r\n{% if true %}x{% endif %}\r\nz\n",
    "\t {% set x = 1 %} text {% if x %}\n\tok{% endif %}\n",
]
ERROR_SNIPPETS = [
    "{{ x.y }}",
    "{{ d.zz.c }}",
    "{{ 'a' + 1 }}",
    "{{ x + 1 }}",
    "{{ raise_exception('custom message') }}",
    "{{ n[1:] }}",
    "{{ 1 / 0 }}",
    "{{ x|tojson }}",
    "{{ 'a' in 1 }}",
    "{% set n.x = 1 %}",
    "{{ l|items|list }}",
    "{{ '{} {0}'.format(1) }}",
    "{{ -x|default(1) }}",  # the filter takes -x, which fails
    "{{ -l|length }}",
    "{% if true %}{{ 1|from_json }}{% endif %}",
]


def jinja2_render(source):
    env = NewerTransformersEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = (lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False:
                             json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                        separators=separators, sort_keys=sort_keys))

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
        return {"text": env.from_string(source).render(**VARIABLES)}
    except Exception as e:  # noqa: BLE001 - any error: kdn must fail too
        return {"error": type(e).__name__, "message": str(e)}


def test_jinja_snippets_render_as_jinja2_renders_them():
    snippets = SNIPPETS + WHITESPACE_SNIPPETS
    got = kdn([{"template": s, "variables": VARIABLES} for s in snippets])
    for source, out in zip(snippets, got):
        want = jinja2_render(source)
        assert "text" in want, f"{source!r}: the reference fails: {want}"
        assert out == {"text": want["text"]}, source


def test_jinja_errors_are_errors_where_jinja2_has_them():
    got = kdn([{"template": s, "variables": VARIABLES} for s in ERROR_SNIPPETS])
    for source, out in zip(ERROR_SNIPPETS, got):
        want = jinja2_render(source)
        assert "error" in want, f"{source!r}: the reference renders it: {want}"
        assert out.get("error") == "INVALID_ARGUMENT", f"{source!r}: {out}"
        if want["error"] == "TemplateError":  # raise_exception: the message as it is
            assert out["message"] == want["message"]
        else:
            assert out["message"].startswith("template, line 1: "), out["message"]
            assert want["message"] in out["message"], f"{source!r}: {out['message']}"
