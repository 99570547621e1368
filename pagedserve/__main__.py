import sys

from pagedserve.common.process import die_with_launcher

die_with_launcher()

from pagedserve.entrypoints.cli import main  # noqa: E402 - after the child asked to die with its launcher

sys.exit(main())
