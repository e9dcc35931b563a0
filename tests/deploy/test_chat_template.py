"""A model folder's own chat template, served (docs/serving.md, "Chat").

The tiny model's folder gets a chat_template.jinja that writes BOS itself,
trims the messages and refuses roles that do not alternate, as real templates
do. The router renders it for /v1/chat/completions with no BOS added, turns
its raise_exception into a 400, and refuses to start on a template that does
not parse, naming the file and the line.
"""
import shutil
import subprocess

import pytest

from deploy_util import Deployment, binary

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}\n"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}\n"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "{% endif %}\n"
    "[{{ m.role }}]{{ m.content | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}[assistant]{% endif %}\n"
)


@pytest.fixture(scope="module")
def templated(tiny_model, tmp_path_factory):
    model = tmp_path_factory.mktemp("models") / "tiny-templated"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    d = Deployment(tmp_path_factory.mktemp("run-templated"), model)
    try:
        yield d
    finally:
        d.down()


def test_chat_renders_the_folders_template_with_no_bos_added(templated):
    chat = templated.chat([{"role": "user", "content": "  hi  "}], max_tokens=2, temperature=0)
    # The same text as a completion: the completion adds BOS, the chat does not
    # (the template wrote <s> itself).
    text = "<s>[user]hi</s>\n[assistant]"  # trim_blocks trims after %}, not after }}
    completion = templated.completion(text, max_tokens=2, temperature=0)
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"] - 1
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


def test_chat_template_raise_exception_is_a_400_with_its_message(templated):
    r = templated.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == ("the model's chat template refused the messages: "
                                "Conversation roles must alternate user/assistant/user/assistant/...")
    assert error["param"] == "messages"


def test_router_refuses_to_start_on_a_chat_template_that_does_not_parse(tiny_model, tmp_path):
    model = tmp_path / "tiny-broken"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}\n")
    # Unreachable workers: the template is read before any is contacted.
    r = subprocess.run([binary("kdn-router"), "--model", str(model), "--port", "0",
                        "--prefill", "tcp://127.0.0.1:9", "--decode", "tcp://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert str(model / "chat_template.jinja") + ", line 2: " in r.stderr + r.stdout, r.stderr
