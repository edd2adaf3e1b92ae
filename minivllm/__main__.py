"""``python -m minivllm ...`` is the ``minivllm`` command (so ``torchrun -m minivllm ...`` works)."""

import sys

from minivllm.cli import main

if __name__ == "__main__":
    sys.exit(main())
