"""`python -m controller.kube.emulator [--port N]`: serve one on localhost, print its URL."""

import sys

from controller.kube.emulator.server import main

sys.exit(main())
