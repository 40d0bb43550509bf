import sys

from subquad.cli import main

sys.exit(main())
