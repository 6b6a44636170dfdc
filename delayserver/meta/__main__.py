"""`python -m delayserver.meta ARGS` is `delayserver meta ARGS`."""
import sys

from delayserver.meta.server import main_meta

sys.exit(main_meta(sys.argv[1:]))
