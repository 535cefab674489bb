import sys

from kvmemory.cli import main

sys.exit(main())
