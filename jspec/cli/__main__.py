"""`python -m jspec.cli`: the `jspec` command."""

import sys

from jspec.cli import main

sys.exit(main())
