import sys

from blockdiff.entrypoints.cli import main

sys.exit(main())
