"""``python -m hpml_compile`` is the ``hpml-compile`` command."""

import sys

from .cli import main

sys.exit(main())
