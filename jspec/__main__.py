"""`python -m jspec`: the `jspec` command (as `python -m jspec.cli`)."""

import sys

from jspec.cli import main

sys.exit(main())
