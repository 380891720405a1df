"""Encoding of generated media: images as PNG, videos as MP4 (PyAV) or raw frame arrays.

MP4 needs PyAV (`pip install torchneuron[diffusion]`); without it a video is returned as a
NumPy `.npy` array of uint8 frames [frames, height, width, 3] and `video_media_type()` says so.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["encode_png", "encode_video", "video_media_type"]


def encode_png(image: Any) -> bytes:
    """PNG bytes of a PIL image."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _have_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def video_media_type() -> str:
    """`video/mp4` when PyAV is installed, else `application/x-npy` (uint8 frame arrays)."""
    return "video/mp4" if _have_av() else "application/x-npy"


def encode_video(frames: np.ndarray, fps: float) -> bytes:
    """The video's bytes in `video_media_type()`: H.264 MP4, or an .npy array of the frames."""
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    if not _have_av():
        buffer = io.BytesIO()
        np.save(buffer, frames)
        return buffer.getvalue()
    import av

    height, width = frames.shape[1:3]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=max(1, round(fps)))
        stream.width, stream.height = width + width % 2, height + height % 2  # yuv420p needs even sides
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            if frame.shape[:2] != (stream.height, stream.width):
                frame = np.pad(frame, ((0, stream.height - height), (0, stream.width - width), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()
