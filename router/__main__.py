"""``python -m router [serve] [--config PATH] [--host H] [--port P]``."""

import sys

from router.cli import main

sys.exit(main())
