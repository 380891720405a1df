"""Batching of concurrent generation requests into single pipeline calls.

`Batcher` owns one worker thread in front of a `ServedPipeline`. Requests are submitted with
their shape (size, frames, steps, guidance: everything but the prompt, seed and n); the worker
takes the oldest waiting request, waits up to `window_s` for others of the same shape, and runs
them together as one call of at most `max_images(shape)` images. Requests of other shapes wait
for the next call. Each submission returns a `concurrent.futures.Future` of that request's
outputs; a request cancelled before its call starts is dropped without running, one cancelled
during its call leaves the call at the next step boundary (`ServedPipeline.generate`) and its
future raises `Cancelled`, while the others of the call go on.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .pipelines import Cancelled, GenerationJob, ServedPipeline

__all__ = ["Batcher"]


@dataclass
class _Pending:
    key: tuple
    shape: dict
    job: GenerationJob
    future: Future


class Batcher:
    """Groups same-shape requests arriving within `window_s` of each other into one call."""

    def __init__(self, served: ServedPipeline, *, window_s: float = 0.05) -> None:
        self.served = served
        self.window_s = window_s
        self.requests = 0
        self.cancelled = 0
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="diffusion-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: GenerationJob, shape: dict) -> Future:
        future: Future = Future()
        with self._cond:
            self.requests += 1
            self._pending.append(_Pending(tuple(sorted(shape.items())), shape, job, future))
            self._cond.notify_all()
        return future

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # ---- worker ------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Pending]:
        with self._cond:
            while not self._pending and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return []
            first = self._pending[0]
            deadline = time.monotonic() + self.window_s
            while (remaining := deadline - time.monotonic()) > 0 and not self._stopped:
                self._cond.wait(remaining)
            try:
                limit = self.served.max_images(first.shape)
            except Exception:  # the probe failed: run alone, the call reports the error
                limit = first.job.n
            batch, images = [], 0
            for pending in list(self._pending):
                if pending.key != first.key:
                    continue
                if batch and images + pending.job.n > limit:
                    break
                batch.append(pending)
                images += pending.job.n
                self._pending.remove(pending)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                return
            live = []
            for pending in batch:
                if pending.job.cancelled.is_set():
                    self.cancelled += 1
                    pending.future.set_exception(Cancelled("the request was cancelled before it started"))
                else:
                    live.append(pending)
            if not live:
                continue
            try:
                outputs: list[Any] = self.served.generate([p.job for p in live], live[0].shape)
            except BaseException as error:  # every request of the call gets the error; keep serving
                if isinstance(error, Cancelled):
                    self.cancelled += len(live)
                for pending in live:
                    pending.future.set_exception(error)
                continue
            for pending, result in zip(live, outputs):
                if result is None:  # cancelled during the call: its rows left the batch at a step boundary
                    self.cancelled += 1
                    pending.future.set_exception(Cancelled("the request was cancelled at a denoising step boundary; "
                                                           "the other requests of its batch went on"))
                    continue
                if pending.job.cancelled.is_set():
                    self.cancelled += 1
                pending.future.set_result(result)
