import sys

from delayserver.cli import main

sys.exit(main())
