import sys

from trace_proxy.cli import main

sys.exit(main())
