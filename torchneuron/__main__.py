"""`python -m torchneuron ...`: the same command as the `torchneuron` console script."""
import sys

from torchneuron.cli import main

if __name__ == "__main__":
    sys.exit(main())
