"""``python -m producer.gpucheck [--out FILE.json]`` (see the package docstring)."""

import sys

from producer.gpucheck.cli import main

sys.exit(main())
