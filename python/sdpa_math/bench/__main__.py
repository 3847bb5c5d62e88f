"""`python -m sdpa_math.bench run|stats|gate ...`: the command line (cli)."""
import sys

from .cli import main

sys.exit(main())
