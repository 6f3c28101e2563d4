"""The ``flashloop-backend`` console script: ``info``, ``bench``, ``report`` and the host
commands ``demo``, ``generate`` and ``eval``."""

from flashloop_backend.cli.main import EXIT_UNSERVABLE, EXIT_USAGE, build_parser, main

__all__ = ["EXIT_UNSERVABLE", "EXIT_USAGE", "build_parser", "main"]
