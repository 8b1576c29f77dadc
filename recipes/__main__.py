"""``python -m recipes STAGE ...``: the ``eagle`` command, for launchers that start modules
(``accelerate launch -m recipes train ...``, ``torchrun -m recipes train ...``)."""

import sys

from recipes.cli import main

sys.exit(main())
