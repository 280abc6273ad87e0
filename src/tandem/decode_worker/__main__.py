import sys

from tandem.cli import main

sys.exit(main(["worker", "--role", "decode", *sys.argv[1:]]))
