"""``python -m graphrt``: the ``graphrt`` command (see ``graphrt.cli``)."""
import sys

from graphrt.cli import main

sys.exit(main())
