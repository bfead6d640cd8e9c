"""``python -m pallas_cache.sizing.cli``: the console script."""

import sys

from pallas_cache.sizing.cli.entry import console_main

if __name__ == "__main__":
    sys.exit(console_main())
