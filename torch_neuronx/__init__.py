"""Alias of torchneuron under the name of AWS's package, for code (and accelerate) that looks for it."""
from torchneuron import *  # noqa: F401,F403
from torchneuron import __version__  # noqa: F401
