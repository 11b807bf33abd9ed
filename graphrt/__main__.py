"""``python -m graphrt``: the ``graphrt`` command (see ``graphrt.cli.main``)."""
import sys

from graphrt.cli.main import main

sys.exit(main())
