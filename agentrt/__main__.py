import sys

from agentrt.cli import main

sys.exit(main())
