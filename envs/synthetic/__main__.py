"""``python -m envs.synthetic``: see ``envs.synthetic.cli``."""

from envs.synthetic.cli import main

print(main())
