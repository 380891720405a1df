"""The HTTP server of a diffusers pipeline: OpenAI's images API and vLLM-Omni's video API.

Routes:
- `POST /v1/images/generations`: OpenAI images (prompt, n, size, response_format=b64_json; PNG),
  plus diffusion controls (negative_prompt, num_inference_steps, guidance_scale, seed).
  `"stream": true` answers with server-sent events: one `image_generation.progress` per
  denoising step, then one `image_generation.completed` per image.
- `POST /v1/videos`: vLLM-Omni's shape (prompt, size, seconds, fps, num_frames, ...): creates a
  video job and returns its record (`status`, `progress` 0-100); `GET /v1/videos/{id}` polls it,
  `GET /v1/videos/{id}/content` downloads the video (MP4, or .npy frames without PyAV),
  `DELETE /v1/videos/{id}` cancels it. `"stream": true` streams `video_generation.progress`
  events and ends with the completed record.
- `GET /v1/models`, `GET /health`, `GET /v1/diffusion/stats` (requests, pipeline calls, cancels,
  images of cancelled requests dropped from a running call).

Concurrent requests of the same shape are batched into one pipeline call (`Batcher`). Bad
input is a 400 whose message names the limit; a client that disconnects has its request
cancelled at the next denoising step; the server keeps serving after any request error.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from .batching import Batcher
from .media import encode_png, encode_video, video_media_type
from .pipelines import Cancelled, GenerationJob, RequestError, ServedPipeline

__all__ = ["ImageRequest", "VideoRequest", "create_app"]

logger = logging.getLogger("torchneuron.serving.diffusion")


class ImageRequest(BaseModel):
    prompt: str
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = None
    response_format: str = "b64_json"
    negative_prompt: str = ""
    num_inference_steps: int = Field(default=4, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    user: str | None = None


class VideoRequest(BaseModel):
    prompt: str
    model: str | None = None
    size: str | None = None
    seconds: str | None = Field(default=None, pattern=r"^[1-9]\d*$")
    fps: float = Field(default=8.0, ge=1.0, le=120.0)
    num_frames: int | None = Field(default=None, ge=1)
    negative_prompt: str = ""
    num_inference_steps: int = Field(default=4, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class _Progress:
    """A request's step events, handed from the batcher's thread to the request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.step, self.total = 0, 0

    def __call__(self, step: int, total: int) -> None:  # called on the batcher's thread
        self.step, self.total = step, total
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (step, total))


def create_app(served: ServedPipeline, *, model_name: str = "diffusion", window_s: float = 0.05) -> FastAPI:
    """A FastAPI app serving `served`; one batcher thread runs its pipeline calls."""
    batcher = Batcher(served, window_s=window_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        batcher.close()

    app = FastAPI(title="torchneuron diffusion server", lifespan=lifespan)
    videos: dict[str, dict] = {}
    app.state.batcher, app.state.served, app.state.videos = batcher, served, videos

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                             for e in error.errors())
        return _error(400, f"invalid request: {problems}")

    def _job(request: ImageRequest | VideoRequest, n: int, progress: _Progress) -> GenerationJob:
        job = GenerationJob(request.prompt, n, request.seed if request.seed is not None else secrets.randbelow(2**31),
                            request.negative_prompt, on_step=progress)
        warning = served.truncation_warning(request.prompt)
        if warning:
            logger.warning(warning)
            job.warnings.append(warning)
        return job

    def _shape(width: int, height: int, steps: int, guidance: float | None, frames: int | None) -> dict:
        served.check_steps(steps)
        shape = {"width": width, "height": height, "num_inference_steps": steps, "guidance_scale": guidance}
        if served.is_video:
            shape["num_frames"] = frames
        return shape

    async def _await(future: Any, job: GenerationJob, request: Request | None) -> Any:
        """The job's result; a client that goes away cancels the job at the next step."""
        wrapped = asyncio.wrap_future(future)
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=0.05)
            if done:
                return wrapped.result()
            if request is not None and await request.is_disconnected():
                job.cancelled.set()
                logger.info("client disconnected: request cancelled at the next denoising step")
                return await wrapped

    # ---- images ------------------------------------------------------------------------------
    @app.post("/v1/images/generations")
    async def images(body: ImageRequest, request: Request) -> Any:
        if served.is_video:
            return _error(400, f"{model_name} is a video pipeline: use POST /v1/videos")
        if body.response_format != "b64_json":
            return _error(400, f"response_format {body.response_format!r} is not supported: use 'b64_json'",
                          param="response_format")
        try:
            width, height = served.parse_size(body.size)
            shape = _shape(width, height, body.num_inference_steps, body.guidance_scale, None)
            served.check_images(body.n, shape)
        except RequestError as error:
            return _error(400, str(error))
        progress = _Progress()
        job = _job(body, body.n, progress)
        future = batcher.submit(job, shape)

        def completed(images: list) -> list[dict]:
            return [{"b64_json": base64.b64encode(encode_png(image)).decode(), "revised_prompt": None}
                    for image in images]

        if not body.stream:
            try:
                result = await _await(future, job, request)
            except Cancelled as error:
                return _error(499, str(error), kind="cancelled")
            except Exception as error:  # the pipeline failed: report it, keep serving
                logger.exception("image generation failed")
                return _error(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error")
            return {"created": int(time.time()), "data": completed(result), "warnings": job.warnings,
                    "size": f"{width}x{height}", "output_format": "png"}

        async def events() -> AsyncIterator[bytes]:
            async for kind, payload in _stream(future, job, progress):
                if kind == "progress":
                    yield _sse({"type": "image_generation.progress", **payload})
                elif kind == "error":
                    yield _sse({"type": "error", "error": payload})
                else:
                    for index, item in enumerate(completed(payload)):
                        yield _sse({"type": "image_generation.completed", "index": index, **item,
                                    "size": f"{width}x{height}", "output_format": "png",
                                    "warnings": job.warnings})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _stream(future: Any, job: GenerationJob, progress: _Progress) -> AsyncIterator[tuple[str, Any]]:
        """Progress events until the job ends; closing the stream (client gone) cancels it."""
        wrapped = asyncio.wrap_future(future)
        try:
            while not wrapped.done() or not progress.queue.empty():
                getter = asyncio.ensure_future(progress.queue.get())
                done, _ = await asyncio.wait({getter, wrapped}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    step, total = getter.result()
                    yield "progress", {"step": step, "num_inference_steps": total}
                else:
                    getter.cancel()
            try:
                yield "completed", wrapped.result()
            except Exception as error:
                yield "error", {"message": f"{type(error).__name__}: {error}"}
        finally:
            if not wrapped.done():
                job.cancelled.set()
                logger.info("event stream closed: request cancelled at the next denoising step")

    # ---- videos ------------------------------------------------------------------------------
    def _frames(body: VideoRequest) -> int:
        if body.num_frames is not None:
            served.check_frames(body.num_frames)
            return body.num_frames
        if body.seconds is None:
            return served.default_frames
        step = int(getattr(served.pipe, "vae_scale_factor_temporal", 1))
        wanted = max(1, round(float(body.seconds) * body.fps))
        return 1 + step * max(0, round((wanted - 1) / step))  # the nearest count the VAE produces

    def _record(video_id: str) -> dict:
        entry = videos[video_id]
        return {key: value for key, value in entry.items() if not key.startswith("_")}

    @app.post("/v1/videos")
    async def create_video(body: VideoRequest) -> Any:
        if not served.is_video:
            return _error(400, f"{model_name} is an image pipeline: use POST /v1/images/generations")
        try:
            width, height = served.parse_size(body.size)
            frames = _frames(body)
            shape = _shape(width, height, body.num_inference_steps, body.guidance_scale, frames)
            served.check_images(1, shape)
        except RequestError as error:
            return _error(400, str(error))
        progress = _Progress()
        job = _job(body, 1, progress)
        video_id = f"video_gen_{uuid.uuid4().hex}"
        videos[video_id] = {
            "id": video_id, "object": "video", "model": body.model or model_name, "prompt": body.prompt,
            "status": "queued", "progress": 0, "size": f"{width}x{height}", "num_frames": frames,
            "fps": body.fps, "seconds": str(max(1, round(frames / body.fps))), "duration_s": frames / body.fps,
            "created_at": int(time.time()), "completed_at": None, "error": None,
            "media_type": video_media_type(), "warnings": job.warnings, "_job": job, "_content": None,
        }
        future = batcher.submit(job, shape)

        async def run() -> AsyncIterator[tuple[str, Any]]:
            entry = videos[video_id]
            async for kind, payload in _stream(future, job, progress):
                if kind == "progress":
                    entry["status"] = "in_progress"
                    entry["progress"] = int(100 * payload["step"] / payload["num_inference_steps"])
                elif kind == "error":
                    entry.update(status="failed", error={"code": "generation_failed", "message": payload["message"]})
                else:
                    entry["_content"] = await asyncio.to_thread(encode_video, payload[0], body.fps)
                    entry.update(status="completed", progress=100, completed_at=int(time.time()))
                yield kind, payload

        if body.stream:
            async def events() -> AsyncIterator[bytes]:
                async for kind, payload in run():
                    if kind == "progress":
                        yield _sse({"type": "video_generation.progress", "id": video_id, **payload})
                yield _sse({"type": "video_generation.completed", **_record(video_id)})
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def drain() -> None:
            async for _ in run():
                pass

        videos[video_id]["_task"] = asyncio.ensure_future(drain())
        return _record(video_id)

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> Any:
        if video_id not in videos:
            return _error(404, f"no video {video_id!r}", param="video_id")
        return _record(video_id)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str) -> Any:
        entry = videos.get(video_id)
        if entry is None:
            return _error(404, f"no video {video_id!r}", param="video_id")
        if entry["_content"] is None:
            return _error(409, f"video {video_id} is {entry['status']}: poll GET /v1/videos/{video_id} "
                               "until its status is 'completed'")
        return Response(entry["_content"], media_type=entry["media_type"])

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> Any:
        entry = videos.pop(video_id, None)
        if entry is None:
            return _error(404, f"no video {video_id!r}", param="video_id")
        entry["_job"].cancelled.set()
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    # ---- metadata ----------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "torchneuron"}]}

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/v1/diffusion/stats")
    async def stats() -> Any:
        return {"requests": batcher.requests, "pipeline_calls": served.calls, "cancelled": batcher.cancelled,
                "dropped_images": served.dropped_images,
                "device": str(served.device), "kind": "video" if served.is_video else "image",
                "size_multiple": served.size_multiple, "default_size": "x".join(map(str, served.default_size)),
                "max_prompt_tokens": served.max_tokens}

    return app
