"""`torchneuron serve` (vLLM's OpenAI server on neuron) against the official `openai` client, on
127.0.0.1 only. One server for the module (tiny Llama, bf16); its last test stops it with SIGTERM
and checks that no process it started survives."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest
import torch

from tests.serving.engine import kill_session

openai = pytest.importorskip("openai")

HOST = "127.0.0.1"
START_TIMEOUT_S = 600  # engine start is 11-18 s on an idle host; shared CI machines are slower


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: str) -> None:
        self.port = _free_port()
        self.name = os.path.basename(model_dir)
        self.url = f"http://{HOST}:{self.port}"
        cmd = [sys.executable, "-m", "torchneuron.cli", "serve", model_dir, "--target", "trn2", "--host", HOST,
               "--port", str(self.port), "--max-model-len", "256", "--max-num-seqs", "8", "--dtype", "bfloat16",
               "--gpu-memory-utilization", "0.02", "--enable-prefix-caching"]
        self.log = open(os.path.join(os.path.dirname(model_dir), "server.log"), "w")
        # a session of its own: the engine-core process the server starts is killed with it (stop())
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if self.get("/health")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(1)
        else:
            raise TimeoutError(f"server not ready in {START_TIMEOUT_S} s; see {self.log.name}")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=120)

    def stop(self) -> None:
        """SIGTERM (the server's clean shutdown), then whatever of its session is left, killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        kill_session(self.proc)

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, r.read().decode()

    def post_raw(self, path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def metric_reaches(self, name: str, at_least: float, timeout_s: float = 15.0) -> float:
        """The metric once it reaches `at_least` (or its value at the timeout): vLLM records a step's
        metrics after it has sent the step's outputs, so a read right after a response can be one step old."""
        deadline = time.time() + timeout_s
        while (value := self.metric(name)) < at_least and time.time() < deadline:
            time.sleep(0.2)
        return value


@pytest.fixture(scope="module")
def server(tiny_model):
    s = Server(tiny_model("llama", torch.bfloat16))
    yield s
    s.stop()


def test_models_and_health(server):
    assert server.get("/health")[0] == 200
    assert [m.id for m in server.client.models.list().data] == [server.name]


def test_streaming_chat_carries_modeled_time(server):
    stream = server.client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "Hello, how are you?"}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, usage = [], None
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 12 and "".join(text)
    neuron = usage.model_extra["neuron"]
    assert neuron["target"] == "trn2" and neuron["output_tokens"] == 12
    assert 0 < neuron["ttft_s"] < 1e-2 and 0 < neuron["tpot_s"] < 1e-2
    # the same request unstreamed gives the same text
    full = server.client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "Hello, how are you?"}], max_tokens=12,
        temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.content == "".join(text)
    assert full.usage.model_extra["neuron"]["output_tokens"] == 12


def test_completions_n_stop_logprobs(server):
    out = server.client.completions.create(model=server.name, prompt="The quick brown fox", max_tokens=10, n=3,
                                           temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert len(out.choices) == 3 and out.usage.completion_tokens == 30
    assert out.usage.model_extra["neuron"]["output_tokens"] == 30
    greedy = server.client.completions.create(model=server.name, prompt="The quick brown fox", max_tokens=10,
                                              temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = greedy.choices[0]
    assert len(choice.logprobs.tokens) == 10 and all(len(t) >= 2 for t in choice.logprobs.top_logprobs)
    stop = choice.text[4:6]
    stopped = server.client.completions.create(model=server.name, prompt="The quick brown fox", max_tokens=10,
                                               temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert choice.text.startswith(stopped.choices[0].text)


def test_bad_requests_get_4xx_with_vllm_error_body(server):
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": "no-such-model", "prompt": "hi", "max_tokens": 2}).encode(), 404),
        (json.dumps({"model": server.name, "prompt": "hi " * 400, "max_tokens": 2}).encode(), 400),  # > context
        (json.dumps({"model": server.name, "prompt": "hi", "temperature": -1}).encode(), 400),
        (json.dumps({"model": server.name, "prompt": "hi", "top_p": 0}).encode(), 400),
    ]
    for body, status in cases:
        code, payload = server.post_raw("/v1/completions", body)
        assert code == status, (body[:60], code, payload)
        assert payload["error"]["message"] and payload["error"]["code"] == status
    ok = server.client.completions.create(model=server.name, prompt="still up?", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_prefix_cache_hits_show_in_metrics(server):
    prefix = "Paged attention reads the KV cache block by block from a block table. " * 6
    before = server.metric("vllm:prefix_cache_hits_total")
    for suffix in (" first", " second"):
        server.client.completions.create(model=server.name, prompt=prefix + suffix, max_tokens=2)
    assert server.metric_reaches("vllm:prefix_cache_hits_total", before + 32) - before >= 32
    text = server.get("/metrics")[1]
    assert 'torchneuron:modeled_ttft_seconds_count{target="trn2"}' in text
    assert server.metric_reaches("torchneuron:modeled_tpot_seconds_count", 1) > 0


def test_client_disconnect_frees_kv_blocks(server):
    """A stream whose client goes away is aborted: it stops generating well before max_tokens and its KV
    blocks return to the free pool. (Not a read of `num_requests_running` while the stream is open: vLLM
    updates that gauge after it has already sent the step's event, so a read right after the first event can
    still see the previous step's 0.)"""
    import http.client

    max_tokens = 250  # all the context the server allows (256) after the prompt
    generated_before = server.metric("vllm:generation_tokens_total")
    conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
    body = json.dumps({"model": server.name, "prompt": "one two three", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the first event: the request holds KV blocks now
    conn.sock.close()
    conn.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        if server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.5)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0  # every block back in the free pool
    generated = server.metric("vllm:generation_tokens_total") - generated_before
    assert 1 <= generated < max_tokens  # aborted on disconnect, not run to max_tokens


@pytest.mark.slow
def test_64_concurrent_streaming_clients(server):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": f"client {i} says hello"}], max_tokens=8,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    async def all_clients():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), timeout=60)

    results = asyncio.run(all_clients())
    assert results == [8] * 64  # 0 errors, 0 lost requests, every stream complete


def test_sigterm_shuts_down_without_orphans(server):
    parent = psutil.Process(server.proc.pid)
    children = parent.children(recursive=True)
    assert children  # vLLM's engine core and worker processes
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=120) is not None
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, f"orphans: {alive}"
