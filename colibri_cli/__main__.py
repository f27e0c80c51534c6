import sys

from colibri_cli.main import main

sys.exit(main())
