"""`python -m hf2q`: the `hf2q` command."""
import sys

from hf2q.cli import main

sys.exit(main())
