"""The diffusion server on 127.0.0.1 with a real HTTP client: images, videos, batching, bad input."""
import base64
import io
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from torchneuron.examples.tiny_diffusion import build_pipeline  # noqa: E402
from torchneuron.serving.diffusion.app import create_app  # noqa: E402
from torchneuron.serving.diffusion.pipelines import ServedPipeline, load_pipeline  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(kind: str, directory, window_s: float = 0.3):
    if kind == "unet":  # served from a diffusers directory, as `torchneuron serve-diffusion DIR` does
        build_pipeline(kind).save_pretrained(directory)
        pipe = load_pipeline(str(directory), "neuron")
    else:  # loading Wan's fp32-pinned modules from disk needs accelerate (the `diffusion` extra)
        pipe = build_pipeline(kind).to("neuron")
    served = ServedPipeline(pipe)
    app = create_app(served, model_name=f"tiny-{kind}", window_s=window_s)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    for _ in range(200):
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    return server, thread, client, served


def _running(kind: str, tmp_path_factory):
    server, thread, client, served = _serve(kind, tmp_path_factory.mktemp(kind))
    yield client, served
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    yield from _running("unet", tmp_path_factory)


@pytest.fixture(scope="module")
def video_server(tmp_path_factory):
    yield from _running("video", tmp_path_factory)


def _png(item: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))


def _stats(client) -> dict:
    return client.get("/v1/diffusion/stats").json()


def test_images_are_the_pipelines_images(image_server):
    client, served = image_server
    r = client.post("/v1/images/generations", json={"prompt": "a cat", "n": 2, "size": "32x32", "seed": 7,
                                                    "num_inference_steps": 2, "guidance_scale": 4.0})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 2
    images = [_png(item) for item in data]
    assert images[0].shape == (32, 32, 3)
    # the same call made directly: one generator per image, seeds 7 and 8
    gens = [torch.Generator("neuron").manual_seed(s) for s in (7, 8)]
    ref = served.pipe(["a cat"] * 2, negative_prompt=["", ""], num_inference_steps=2, guidance_scale=4.0,
                      height=32, width=32, generator=gens).images
    for got, want in zip(images, ref):
        np.testing.assert_array_equal(got, np.asarray(want))
    assert not np.array_equal(images[0], images[1])  # different seeds, different images


def test_stream_reports_every_step(image_server):
    client, _ = image_server
    events = []
    with client.stream("POST", "/v1/images/generations",
                       json={"prompt": "a dog", "size": "32x32", "num_inference_steps": 3, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    steps = [e["step"] for e in events if e["type"] == "image_generation.progress"]
    assert steps == [1, 2, 3]
    done = [e for e in events if e["type"] == "image_generation.completed"]
    assert len(done) == 1 and _png(done[0]).shape == (32, 32, 3)


def test_concurrent_requests_share_pipeline_calls(image_server):
    client, _ = image_server
    before = _stats(client)
    body = {"prompt": "a tree", "size": "32x32", "num_inference_steps": 2}
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda i: client.post("/v1/images/generations", json=dict(body, seed=i)), range(4)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    after = _stats(client)
    assert after["requests"] - before["requests"] == 4
    assert after["pipeline_calls"] - before["pipeline_calls"] < 4


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "size": "big"}, "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": "30x30"}, "multiples of 4"),
    ({"prompt": "x", "n": 100000, "size": "32x32"}, "at most"),
    ({"prompt": "x", "response_format": "url"}, "b64_json"),
    ({"n": 1}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "num_inference_steps": 5000}, "num_inference_steps"),
])
def test_bad_requests_are_400_naming_the_limit(image_server, body, needle):
    client, _ = image_server
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_malformed_json_and_long_prompts(image_server):
    client, _ = image_server
    r = client.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid request" in r.json()["error"]["message"]
    r = client.post("/v1/images/generations", json={"prompt": "a very long prompt " * 10, "size": "32x32",
                                                    "num_inference_steps": 1})
    assert r.status_code == 200
    assert any("truncated" in w for w in r.json()["warnings"])
    assert client.get("/health").json() == {"status": "ok"}  # still serving


def test_client_disconnect_cancels_at_a_step_boundary(image_server):
    client, _ = image_server
    before = _stats(client)
    with httpx.Client(base_url=client.base_url, timeout=1.0) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/images/generations", json={"prompt": "slow", "size": "32x32", "num_inference_steps": 500})
    for _ in range(600):
        if _stats(client)["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.05)
    assert _stats(client)["cancelled"] == before["cancelled"] + 1
    r = client.post("/v1/images/generations", json={"prompt": "next", "size": "32x32", "num_inference_steps": 1})
    assert r.status_code == 200  # the server is free again


def test_disconnect_in_a_mixed_batch_cancels_only_that_request(image_server):
    """Two requests of one shape share a call; one client goes away mid-call. Its image leaves the
    batch at the next step boundary (the denoiser runs on the other's rows only), its request counts
    as cancelled, and the other request gets the image it gets when served alone."""
    client, served = image_server
    before = _stats(client)
    body = {"size": "32x32", "num_inference_steps": 40, "guidance_scale": 4.0}

    def impatient() -> None:
        with httpx.Client(base_url=client.base_url, timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/images/generations", json=dict(body, prompt="gone", seed=1))

    with ThreadPoolExecutor(2) as pool:
        gone = pool.submit(impatient)
        time.sleep(0.05)  # inside the batching window
        stays = pool.submit(client.post, "/v1/images/generations", json=dict(body, prompt="stays", seed=2))
        gone.result()
        r = stays.result()
    assert r.status_code == 200, r.text
    after = _stats(client)
    assert after["pipeline_calls"] - before["pipeline_calls"] == 1  # one call held both requests
    assert after["cancelled"] - before["cancelled"] == 1
    assert after["dropped_images"] - before["dropped_images"] == 1  # cut from the call, not run to the end
    got = _png(r.json()["data"][0])
    want = served.pipe(["stays"], negative_prompt=[""], num_inference_steps=40, guidance_scale=4.0, height=32,
                       width=32, generator=[torch.Generator("neuron").manual_seed(2)]).images[0]
    # the first steps ran at batch 2 and the rest at batch 1: equal up to PNG rounding of ulp differences
    assert np.abs(got.astype(int) - np.asarray(want).astype(int)).max() <= 1


def test_video_job_and_content(video_server):
    client, _ = video_server
    r = client.post("/v1/videos", json={"prompt": "waves", "size": "16x16", "num_frames": 5,
                                        "num_inference_steps": 2, "seed": 1})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress", "completed")
    for _ in range(2400):
        job = client.get(f"/v1/videos/{job['id']}").json()
        if job["status"] in ("completed", "failed"):
            break
        time.sleep(0.05)
    assert job["status"] == "completed" and job["progress"] == 100, job
    content = client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200
    if job["media_type"] == "video/mp4":
        assert content.content[4:8] == b"ftyp"
    else:
        frames = np.load(io.BytesIO(content.content))
        assert frames.shape == (5, 16, 16, 3) and frames.dtype == np.uint8


def test_video_stream_and_bad_frames(video_server):
    client, _ = video_server
    r = client.post("/v1/videos", json={"prompt": "x", "size": "16x16", "num_frames": 6})
    assert r.status_code == 400 and "4k+1" in r.json()["error"]["message"]
    r = client.post("/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 400 and "/v1/videos" in r.json()["error"]["message"]
    events = []
    with client.stream("POST", "/v1/videos", json={"prompt": "rain", "size": "16x16", "seconds": "1", "fps": 4,
                                                   "num_inference_steps": 2, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert [e["step"] for e in events if e["type"] == "video_generation.progress"] == [1, 2]
    done = events[-1]
    assert done["type"] == "video_generation.completed" and done["status"] == "completed"
    assert done["num_frames"] == 5  # 1 s at 4 fps, snapped to the VAE's 4k+1 frames


def test_dit_pipeline_reports_progress_and_cancels_through_the_older_callback():
    """PixArt's __call__ takes only diffusers' older `callback(step, t, latents)`: the served
    pipeline reports every step through it and stops a call whose requests are all cancelled."""
    from torchneuron.serving.diffusion.pipelines import Cancelled, GenerationJob

    served = ServedPipeline(build_pipeline("dit").to("neuron"))
    steps = []
    job = GenerationJob("a cube", 1, 0, on_step=lambda step, total: steps.append((step, total)))
    shape = {"width": 16, "height": 16, "num_inference_steps": 2, "guidance_scale": 4.5}
    (images,) = served.generate([job], shape)
    assert steps == [(1, 2), (2, 2)] and images[0].size == (16, 16)
    job = GenerationJob("a cube", 1, 0, on_step=lambda step, total: job.cancelled.set())
    with pytest.raises(Cancelled, match="cancelled at step 2"):
        served.generate([job], shape)
