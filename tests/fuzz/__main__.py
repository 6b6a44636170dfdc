import sys

from tests.fuzz.harness import main

main(sys.argv)
