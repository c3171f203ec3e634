"""``python -m djl_stream``: the ``djl-stream`` command line.

    $ python -m djl_stream serve model/ --port 8080
"""

from __future__ import annotations

import sys

from djl_stream.cli import main

if __name__ == "__main__":
    sys.exit(main())
