"""The tiny-checkpoint builders, under the name the tests and the README use; they live in
``vlmd/tiny`` (``vlmd serve`` builds its embedded default with them).

    python -m vlmd.testing.tiny --family FAMILY --out DIR [--seed N] [--size tiny|small]
"""

from __future__ import annotations

import sys

from vlmd.tiny import SIZES, build_tiny, builders, main

__all__ = ["SIZES", "build_tiny", "builders", "main"]

if __name__ == "__main__":
    sys.exit(main())
