"""``python -m infer``: the same as the ``infer`` command."""

import sys

from infer.cli import main

if __name__ == "__main__":
    sys.exit(main())
