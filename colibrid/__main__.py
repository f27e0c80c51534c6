import sys

from colibrid.cli import main

sys.exit(main())
