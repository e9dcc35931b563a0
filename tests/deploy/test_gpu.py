"""The deployment on a GPU (docs/serving.md, "GPUs"): kdn-launch --device cuda
puts a prefill and a decode worker on one GPU, and its greedy answers are the
engine's alone on that GPU (kdn-generate --device cuda), with and without KV
from the KDN, and the CPU deployment's on the shipped models/kdn-qa. A cuda
worker that cannot have its device fails at start, saying why.

Without a GPU every test but the last is skipped; the last then checks the
refusal a machine with no device gives. ctest runs this file under the `gpu`
label too (deployment_gpu).
"""

import json
import shutil
import subprocess

import pytest

from deploy_util import REPO, Deployment, binary

QA_MODEL = REPO / "models" / "kdn-qa"


def cuda_device_present():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    return r.returncode == 0 and "GPU" in r.stdout


GPU = cuda_device_present()
needs_gpu = pytest.mark.skipif(not GPU, reason="no CUDA device on this machine")


def qa_prompts(n):
    """The first n questions of kdn-qa's demo set, as the model was trained
    to read them: the documents, one per line, then Question/Answer."""
    examples = json.loads((QA_MODEL / "demo.json").read_text())[:n]
    return ["".join(d + "\n" for d in e["documents"]) + "Question: " + e["question"] + "\nAnswer:"
            for e in examples]


def generate(prompt, max_tokens, device):
    r = subprocess.run([binary("kdn-generate"), "--model", str(QA_MODEL), "--prompt", prompt,
                        "--max-tokens", str(max_tokens), "--device", device, "--threads", "1"],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout.endswith(b"\n"), r.stdout
    return r.stdout[:-1].decode("utf-8")


def cached_tokens(usage):
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.fixture(scope="module")
def gpu_deployment(tmp_path_factory):
    if not GPU:
        pytest.skip("no CUDA device on this machine")
    d = Deployment(tmp_path_factory.mktemp("run-gpu"), QA_MODEL, "--device", "cuda")
    try:
        yield d
    finally:
        d.down()


@needs_gpu
def test_workers_run_on_the_gpu(gpu_deployment):
    workers = [p for p in gpu_deployment.info["processes"]
               if p["name"].startswith(("prefill", "decode"))]
    assert len(workers) == 2, gpu_deployment.info["processes"]
    assert all(p.get("device") == "cuda:0" for p in workers), workers
    logs = gpu_deployment.log_tails(40)
    assert "cuda:0" in logs, logs


@needs_gpu
def test_greedy_equals_the_engine_alone_on_the_gpu(gpu_deployment):
    for prompt in qa_prompts(3):
        want = generate(prompt, 20, "cuda")
        first = gpu_deployment.completion(prompt, max_tokens=20, temperature=0)
        assert first["choices"][0]["text"] == want, gpu_deployment.log_tails()
        # The same prompt again: its full chunks come from the KDN (bf16 KV
        # the GPU computed), and the answer is the same.
        again = gpu_deployment.completion(prompt, max_tokens=20, temperature=0)
        assert cached_tokens(again["usage"]) > 0, again["usage"]
        assert again["choices"][0]["text"] == want


@needs_gpu
def test_cpu_and_gpu_deployments_answer_alike(gpu_deployment, tmp_path_factory):
    cpu = Deployment(tmp_path_factory.mktemp("run-cpu"), QA_MODEL)
    try:
        for prompt in qa_prompts(4):
            a = cpu.completion(prompt, max_tokens=16, temperature=0)["choices"][0]["text"]
            b = gpu_deployment.completion(prompt, max_tokens=16, temperature=0)["choices"][0]["text"]
            assert a == b, (prompt, a, b)
    finally:
        cpu.down()


def smollm2_gguf():
    """SmolLM2-135M-Instruct's GGUF (scripts/fetch-smollm2.sh; KDN_SMOLLM2
    names another copy), or None."""
    import os
    from pathlib import Path
    p = Path(os.environ.get("KDN_SMOLLM2",
                            Path.home() / ".cache" / "kdn" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return p if p.is_file() else None


@needs_gpu
def test_smollm2_gguf_deployment_on_the_gpu(tmp_path_factory):
    """A real model (Q4_1 GGUF, head_dim 64: FlashInfer and CUDA graphs) on
    a GPU deployment: each turn of a chat gives the engine's own greedy text
    on the GPU (kdn-generate --device cuda on the rendered prompt), and a
    repeated turn reuses KV from the KDN."""
    model = smollm2_gguf()
    if model is None:
        pytest.skip("no SmolLM2 GGUF here (scripts/fetch-smollm2.sh)")
    system = {"role": "system", "content": "Answer in one short sentence."}

    def render(messages):
        return ("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n"
                + "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"])
                          for m in messages[1:])
                + "<|im_start|>assistant\n")

    # The engine's answers first, each turn on the one before: the module's
    # kdn-qa deployment and this one leave too little of the GPU for a third
    # engine beside them.
    messages, wants = [system], []
    for question in ["What is the capital of France?", "And of Germany?"]:
        messages.append({"role": "user", "content": question})
        r = subprocess.run([binary("kdn-generate"), "--model", str(model), "--prompt",
                            render(messages), "--max-tokens", "24", "--device", "cuda",
                            "--no-bos"], capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        wants.append(r.stdout.decode("utf-8")[:-1])
        messages.append({"role": "assistant", "content": wants[-1]})
    # A small share: the kdn-qa deployment of this module holds most of the GPU.
    d = Deployment(tmp_path_factory.mktemp("run-smollm2-gpu"), model, "--device", "cuda",
                   "--gpu-mem-fraction", "0.04")
    try:
        for turn in range(2):
            asked = messages[:2 + 2 * turn]
            got = d.chat(asked, max_tokens=24, temperature=0)
            answer = got["choices"][0]["message"]["content"]
            assert answer == wants[turn] and answer, (wants[turn], answer, d.log_tails())
            again = d.chat(asked, max_tokens=24, temperature=0)
            assert again["choices"][0]["message"]["content"] == answer
            assert cached_tokens(again["usage"]) > 0, again["usage"]
    finally:
        d.down()


def test_a_cuda_worker_without_its_device_fails_clearly():
    """kdn-prefill on cuda with a memory share that cannot hold the model (on
    a GPU machine), or on a machine with no device: it exits non-zero at
    start, before serving, and says why."""
    args = [binary("kdn-prefill"), "--model", str(QA_MODEL), "--listen", "tcp://127.0.0.1:0"]
    if GPU:
        args += ["--device", "cuda:0", "--gpu-mem-fraction", "0.0001"]
        expect = "give it a larger share"
    else:
        args += ["--device", "cuda"]
        expect = ("no CUDA device is visible", "no CUDA backend")
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stdout == "", r.stdout  # never printed an endpoint
    expect = (expect,) if isinstance(expect, str) else expect
    assert any(e in r.stderr for e in expect), r.stderr
    if GPU:
        # Too much KV for the whole device: the free memory is named.
        r = subprocess.run([binary("kdn-decode"), "--model", str(QA_MODEL), "--device", "cuda:0",
                            "--kv-tokens", str(1 << 30)], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and r.stdout == ""
        assert "are free" in r.stderr, r.stderr
