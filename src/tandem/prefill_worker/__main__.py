import sys

from tandem.cli import main

sys.exit(main(["worker", "--role", "prefill", *sys.argv[1:]]))
