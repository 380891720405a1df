"""Serve a local model with vLLM's OpenAI server on the neuron device (`torchneuron serve`).

    torchneuron serve MODEL_DIR [--target trn1|trn2|trn3] [any vLLM server argument ...]

runs `python -m vllm.entrypoints.openai.api_server --model MODEL_DIR ...` in this process's place
(so signals reach vLLM's server directly), with the modeled target set and the middleware below,
which adds the modeled Trainium time of each request to the response's `usage` (as
`usage.neuron = {target, ttft_s, tpot_s, ...}`, also in a stream's final usage chunk) and to
`/metrics` (`torchneuron:modeled_ttft_seconds`, `torchneuron:modeled_tpot_seconds` summaries).
The served model name defaults to the directory's name.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

from torchneuron import settings
from torchneuron.serving import require_extra
from torchneuron.serving.llm.timing import ENV, TimingReader

TARGETS = ("trn1", "trn2", "trn3")
MIDDLEWARE = "torchneuron.serving.llm.server.ModeledTimeMiddleware"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a local Hugging Face model directory (config, weights, tokenizer)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="--target trn1|trn2|trn3, then any argument of vLLM's OpenAI server "
                             "(--host, --port, --max-model-len, --tensor-parallel-size, --dtype, ...)")


def server_command(model_dir: str, vllm_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM server command line and the environment additions for one `serve` call."""
    args = list(vllm_args)
    env: dict[str, str] = {}
    if "--target" in args:
        i = args.index("--target")
        if i + 1 >= len(args) or args[i + 1] not in TARGETS:
            raise SystemExit(f"torchneuron serve: --target takes one of {', '.join(TARGETS)}")
        env["TORCHNEURON_TARGET"] = args[i + 1]
        del args[i:i + 2]
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise SystemExit(f"torchneuron serve: {model_dir!r} is not a model directory (no config.json); "
                         "pass a local Hugging Face model directory.")
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in args):
        args += ["--served-model-name", os.path.basename(os.path.normpath(model_dir))]
    env[ENV] = os.environ.get(ENV) or tempfile.mkdtemp(prefix="torchneuron-serve-")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--middleware", MIDDLEWARE, *args]
    return command, env


def run(args: argparse.Namespace) -> int:
    require_extra("serve", "serve", ("vllm",))
    command, env = server_command(args.model_dir, args.vllm_args)
    os.environ.update(env)
    os.execv(command[0], command)  # vLLM's server becomes this process: SIGTERM reaches it directly
    return 0  # not reached


# ------------------------------------------------------------------------------ the middleware
def modeled_usage(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """usage.neuron of one response from its engine requests' records (n > 1 has several)."""
    if not records:
        return None
    decode_tokens = sum(max(0, r["output_tokens"] - 1) for r in records)
    decode_s = sum(r["decode_s"] for r in records)
    return {"target": records[0]["target"], "ttft_s": max(r["ttft_s"] for r in records),
            "tpot_s": decode_s / decode_tokens if decode_tokens else None,
            "decode_s": decode_s, "output_tokens": sum(r["output_tokens"] for r in records)}


def metrics_text(records: dict[str, dict[str, Any]]) -> str:
    """Prometheus summaries of the modeled TTFT (per request) and TPOT (per decoded token)."""
    by_target: dict[str, list[dict[str, Any]]] = {}
    for record in records.values():
        by_target.setdefault(record["target"], []).append(record)
    lines = ["# HELP torchneuron:modeled_ttft_seconds Modeled Trainium time to first token of each request.",
             "# TYPE torchneuron:modeled_ttft_seconds summary",
             "# HELP torchneuron:modeled_tpot_seconds Modeled Trainium time per output token after the first.",
             "# TYPE torchneuron:modeled_tpot_seconds summary"]
    for target, rs in sorted(by_target.items()):
        label = f'{{target="{target}"}}'
        lines += [f"torchneuron:modeled_ttft_seconds_sum{label} {sum(r['ttft_s'] for r in rs)!r}",
                  f"torchneuron:modeled_ttft_seconds_count{label} {len(rs)}",
                  f"torchneuron:modeled_tpot_seconds_sum{label} {sum(r['decode_s'] for r in rs)!r}",
                  f"torchneuron:modeled_tpot_seconds_count{label} "
                  f"{sum(max(0, r['output_tokens'] - 1) for r in rs)}"]
    return "\n".join(lines) + "\n"


class ModeledTimeMiddleware:
    """ASGI middleware over vLLM's OpenAI app: modeled time in `usage` and `/metrics`."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        directory = settings.current().serving_timing_dir
        self.reader = TimingReader(directory) if directory else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or self.reader is None:
            await self.app(scope, receive, send)
        elif path == "/metrics":
            await self.app(scope, receive, self._buffered(send, self._add_metrics))
        elif path in ("/v1/completions", "/v1/chat/completions"):
            await self.app(scope, receive, _UsageRewriter(send, self._add_usage))
        else:
            await self.app(scope, receive, send)

    def _add_metrics(self, body: bytes) -> bytes:
        return body + metrics_text(self.reader.refresh()).encode()

    def _add_usage(self, payload: dict) -> dict:
        usage = payload.get("usage")
        if isinstance(usage, dict):
            modeled = modeled_usage(self.reader.find(str(payload.get("id", ""))))
            if modeled is not None:
                usage["neuron"] = modeled
        return payload

    @staticmethod
    def _buffered(send: Callable, rewrite: Callable[[bytes], bytes]) -> Callable:
        """A `send` that holds the response until its body is complete, then rewrites it."""
        state: dict[str, Any] = {"start": None, "body": b""}

        async def buffered_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["start"] = message
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            state["body"] += message.get("body", b"")
            if message.get("more_body"):
                return
            body = rewrite(state["body"]) if state["start"]["status"] == 200 else state["body"]
            start = dict(state["start"])
            start["headers"] = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            start["headers"].append((b"content-length", str(len(body)).encode()))
            await send(start)
            await send({"type": "http.response.body", "body": body})

        return buffered_send


class _UsageRewriter:
    """Rewrites the JSON body (or each server-sent event of a stream) that carries `usage`."""

    def __init__(self, send: Callable, rewrite: Callable[[dict], dict]) -> None:
        self.send, self.rewrite = send, rewrite
        self.stream = False
        self.pending = b""
        self.inner = None

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = dict((k.lower(), v) for k, v in message.get("headers", []))
            self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if not self.stream:
                self.inner = ModeledTimeMiddleware._buffered(self.send, self._rewrite_json)
                await self.inner(message)
                return
        elif self.inner is not None:
            await self.inner(message)
            return
        elif message["type"] == "http.response.body":
            data = self.pending + message.get("body", b"")
            events, _, self.pending = data.rpartition(b"\n\n")
            if events:
                message = dict(message, body=b"\n\n".join(self._event(e) for e in events.split(b"\n\n")) + b"\n\n")
            else:
                message = dict(message, body=b"")
            if not message.get("more_body") and self.pending:
                message["body"] += self.pending
                self.pending = b""
        await self.send(message)

    def _rewrite_json(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except ValueError:
            return body
        return json.dumps(self.rewrite(payload)).encode() if isinstance(payload, dict) else body

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or b'"usage"' not in event:
            return event
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(payload, dict) or not payload.get("usage"):
            return event
        return b"data: " + json.dumps(self.rewrite(payload)).encode()
