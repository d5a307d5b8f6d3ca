"""``python -m producer.tools.gpucheck [--out FILE.json]`` (see the package docstring)."""

import sys

from producer.tools.gpucheck.cli import main

sys.exit(main())
