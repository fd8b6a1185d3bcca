"""``python -m fleetmpi.launch``: the same as the ``fleetmpirun`` command."""
import sys

from .fleetmpirun import main

sys.exit(main())
