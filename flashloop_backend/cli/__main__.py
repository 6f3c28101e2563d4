import sys

from flashloop_backend.cli.main import main

sys.exit(main())
