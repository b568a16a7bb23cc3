"""`python -m shared.cli ...`: the `veribus` command."""

import sys

from shared.cli.commands import main

sys.exit(main())
