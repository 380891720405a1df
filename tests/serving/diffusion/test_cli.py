"""`torchneuron serve-diffusion DIR` serves a diffusers directory written by the tiny-pipeline example."""
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("diffusers")
httpx = pytest.importorskip("httpx")

from .test_server import _free_port  # noqa: E402


@pytest.mark.slow  # two fresh interpreters import torch and diffusers
def test_serve_diffusion_command(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "torchneuron.examples.tiny_diffusion", "unet", str(tmp_path / "sd")],
                   check=True, env=env, capture_output=True, timeout=300)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "torchneuron.cli", "serve-diffusion", str(tmp_path / "sd"),
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert server.poll() is None, server.stderr.read().decode()[-2000:]
                time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "sd"
        r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "size": "32x32",
                                                             "num_inference_steps": 1}, timeout=120)
        assert r.status_code == 200 and r.json()["data"][0]["b64_json"]
    finally:
        server.terminate()
        server.wait(timeout=30)
