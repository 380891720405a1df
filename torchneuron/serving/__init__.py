"""torchneuron.serving: inference servers on the neuron device.

`llm/` is the vLLM platform plugin `neuron` (vLLM's engine and OpenAI server on neuron tensors);
`diffusion/` serves diffusers pipelines (OpenAI's images API, vLLM-Omni's videos API).
"""
from __future__ import annotations

import importlib.util


def require_extra(command: str, extra: str, modules: tuple[str, ...]) -> None:
    """Raises SystemExit naming the missing packages and the install that brings them, when one of
    `modules` is not installed: a plain install of torchneuron has no vLLM or diffusers."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"torchneuron {command} needs {', '.join(missing)}, which this environment lacks: "
                         f"install the '{extra}' extra (pip install 'torchneuron[{extra}]', or `make install` "
                         f"in a checkout), then run the command again.")
