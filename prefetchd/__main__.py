import sys

from prefetchd.cli import main

sys.exit(main())
