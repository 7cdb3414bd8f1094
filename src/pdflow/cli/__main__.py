import sys

from pdflow.cli import main

sys.exit(main())
