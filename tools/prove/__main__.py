"""``python -m tools.prove``: prove candidates now and print their verdicts (``tools.prove.main``)."""
import sys

from tools.prove import main

sys.exit(main())
