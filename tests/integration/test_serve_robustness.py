"""A real server under misbehaving clients: concurrency, cancellations, malformed requests.

32 requests from 8 concurrent clients against `vllm serve --speculative-config`
(an EAGLE-2 tree config) and against a server without speculation: every
request that runs to the end gives the same greedy tokens on both. Every 4th
request is streamed and dropped after 3 chunks; every 4th other one is streamed
to the end. Afterwards, malformed requests each get a clear 4xx and the server
still answers correctly.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from test_serve_cli import _serve

pytestmark = pytest.mark.vllm

NUM_REQUESTS, CLIENTS = 32, 8


def _prompt(i: int) -> str:
    return " ".join(f"w{(13 * i + 7 * j) % 250}" for j in range(3 + (i * 5) % 40))


def _request(base: str, model: str, i: int) -> tuple[str, list[int] | str | None]:
    body = {"model": model, "prompt": _prompt(i), "max_tokens": 16 + (i * 7) % 25,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    if i % 4 == 0:  # streamed, then the client disconnects midway
        with requests.post(base + "/v1/completions", json={**body, "stream": True},
                           stream=True, timeout=120) as r:  # fmt: skip
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    chunks += 1
                if chunks == 3:
                    break  # closing the response drops the connection
        return "cancelled", None
    if i % 4 == 1:  # streamed to the end
        text = ""
        with requests.post(base + "/v1/completions", json={**body, "stream": True},
                           stream=True, timeout=120) as r:  # fmt: skip
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return "streamed", text
    r = requests.post(base + "/v1/completions", json={**body, "return_token_ids": True},
                      timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return "tokens", r.json()["choices"][0]["token_ids"]


def _workload(base: str, model: str) -> list:
    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(lambda i: _request(base, model, i), range(NUM_REQUESTS)))


@pytest.fixture(scope="module")
def vanilla_results(tiny, tmp_path_factory):
    with _serve(tiny["target"], tmp_path_factory.mktemp("vanilla"), []) as base:
        return _workload(base, str(tiny["target"]))


@pytest.fixture(scope="module")
def tree_server(tiny, tmp_path_factory, vanilla_results):
    cfg_dir = tmp_path_factory.mktemp("tree")
    cfg = cfg_dir / "eagle2.yaml"
    cfg.write_text(f"method: eagle2\nmodel: {tiny['draft_noisy']}\nnum_speculative_tokens: 3\n"
                   "topk: 3\ntotal_tokens: 8\n")  # fmt: skip
    with _serve(tiny["target"], cfg_dir, ["--speculative-config", str(cfg)]) as base:
        yield base


def test_concurrent_clients_with_cancellations_match_vanilla(tiny, tree_server, vanilla_results):
    got = _workload(tree_server, str(tiny["target"]))
    for i, (mine, theirs) in enumerate(zip(got, vanilla_results)):
        assert mine[0] == theirs[0]
        assert mine[1] == theirs[1], f"request {i} ({mine[0]}) differs from vanilla"
    metrics = requests.get(tree_server + "/metrics", timeout=10).text
    drafts = [ln for ln in metrics.splitlines()
              if ln.startswith("vllm:spec_decode_num_drafts_total")]  # fmt: skip
    assert float(drafts[0].rsplit(" ", 1)[1]) > 0


@pytest.mark.parametrize(
    "name, send, status",
    [
        (
            "bad JSON",
            lambda u, m: requests.post(
                u + "/v1/completions",
                data=b"{not json",
                headers={"Content-Type": "application/json"},
                timeout=30,
            ),
            400,
        ),  # fmt: skip
        (
            "unknown model",
            lambda u, m: requests.post(
                u + "/v1/completions",
                json={"model": "no-such-model", "prompt": "w1", "max_tokens": 4},
                timeout=30,
            ),
            404,
        ),
        (
            "negative max_tokens",
            lambda u, m: requests.post(
                u + "/v1/completions",
                json={"model": m, "prompt": "w1", "max_tokens": -3},
                timeout=30,
            ),
            400,
        ),
        (
            "over-long prompt",
            lambda u, m: requests.post(
                u + "/v1/completions",
                json={"model": m, "prompt": " ".join(["w1"] * 600), "max_tokens": 4},
                timeout=30,
            ),
            400,
        ),
        (
            "empty prompt",
            lambda u, m: requests.post(
                u + "/v1/completions", json={"model": m, "prompt": "", "max_tokens": 4}, timeout=30
            ),
            400,
        ),
    ],
)
def test_malformed_requests_get_a_clear_4xx(tiny, tree_server, name, send, status):
    r = send(tree_server, str(tiny["target"]))
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    assert r.json().get("error", {}).get("message"), r.text[:300]


def test_still_healthy_and_exact_after_all_that(tiny, tree_server, vanilla_results):
    assert requests.get(tree_server + "/health", timeout=10).status_code == 200
    mode, tokens = _request(tree_server, str(tiny["target"]), 2)
    assert (mode, tokens) == vanilla_results[2]
