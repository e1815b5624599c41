"""``python -m onepass``: the ``onepass`` command."""

import sys

from onepass.cli import main

sys.exit(main())
