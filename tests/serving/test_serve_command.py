"""`torchneuron serve`'s command line and its modeled-time middleware, without a server."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from torchneuron.cli import build_parser
from torchneuron.serving.llm import server
from torchneuron.serving.llm.timing import ENV, FILE


def test_serve_passes_vllm_arguments_through(tmp_path, monkeypatch):
    model = tmp_path / "my-llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.delenv(ENV, raising=False)
    args = build_parser().parse_args(["serve", str(model), "--port", "8123", "--target", "trn1",
                                      "--tensor-parallel-size", "2"])
    command, env = server.server_command(args.model_dir, args.vllm_args)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--model") + 1] == str(model)
    assert command[command.index("--port") + 1] == "8123" and "--tensor-parallel-size" in command
    assert command[command.index("--served-model-name") + 1] == "my-llama"
    assert command[command.index("--middleware") + 1] == server.MIDDLEWARE and "--target" not in command
    assert env["TORCHNEURON_TARGET"] == "trn1" and os.path.isdir(env[ENV])


@pytest.mark.parametrize("argv, message", [(["--target", "trn9"], "--target takes one of"), ([], "no config.json")])
def test_serve_rejects_bad_arguments(tmp_path, argv, message):
    if argv:
        (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=message):
        server.server_command(str(tmp_path), argv)


def _records(directory, rows):
    with open(os.path.join(directory, FILE), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_middleware_adds_modeled_time_to_usage_and_stream(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    _records(tmp_path, [
        {"id": "cmpl-abc-0-x1", "target": "trn2", "ttft_s": 2e-4, "tpot_s": 1e-4, "decode_s": 3e-4,
         "output_tokens": 4, "steps": 4},
        {"id": "cmpl-abc-1-x2", "target": "trn2", "ttft_s": 3e-4, "tpot_s": 1e-4, "decode_s": 3e-4,
         "output_tokens": 4, "steps": 4}])
    body = {"id": "cmpl-abc", "usage": {"completion_tokens": 8}}
    events = [b'data: {"id": "cmpl-abc", "choices": [{"text": "a"}], "usage": null}\n\n',
              b'data: {"id": "cmpl-abc", "choices": [], "usage": {"completion_tokens": 8}}\n\ndata: [DONE]\n\n']

    def app_for(messages):
        async def app(scope, receive, send):
            for m in messages:
                await send(m)
        return app

    def run(messages):
        sent = []

        async def send(m):
            sent.append(m)

        middleware = server.ModeledTimeMiddleware(app_for(messages))
        asyncio.run(middleware({"type": "http", "path": "/v1/completions"}, None, send))
        return sent

    plain = run([{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
                 {"type": "http.response.body", "body": json.dumps(body).encode()}])
    usage = json.loads(plain[1]["body"])["usage"]["neuron"]
    assert usage == pytest.approx({"target": "trn2", "ttft_s": 3e-4, "tpot_s": 1e-4, "decode_s": 6e-4,
                                   "output_tokens": 8})
    assert dict(plain[0]["headers"])[b"content-length"] == str(len(plain[1]["body"])).encode()
    streamed = run([{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}]
                   + [{"type": "http.response.body", "body": e, "more_body": True} for e in events]
                   + [{"type": "http.response.body", "body": b""}])
    text = b"".join(m.get("body", b"") for m in streamed[1:]).decode()
    chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert chunks[0]["usage"] is None and chunks[1]["usage"]["neuron"]["output_tokens"] == 8
    assert text.endswith("data: [DONE]\n\n")
    metrics = server.metrics_text(server.TimingReader(str(tmp_path)).refresh())
    assert 'torchneuron:modeled_ttft_seconds_count{target="trn2"} 2' in metrics
    assert 'torchneuron:modeled_tpot_seconds_count{target="trn2"} 6' in metrics
