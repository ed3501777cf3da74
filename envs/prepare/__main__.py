"""``python -m envs.prepare``: see envs/prepare/cli.py."""

import sys

from envs.prepare.cli import main

sys.exit(main())
