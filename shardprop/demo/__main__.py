"""``python -m shardprop.demo``: see :mod:`shardprop.demo.train`."""
import sys

from shardprop.demo.train import main

if __name__ == "__main__":
    sys.exit(main())
