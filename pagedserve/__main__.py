import sys

from pagedserve.entrypoints.cli import main

sys.exit(main())
