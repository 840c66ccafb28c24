"""``python -m mlx_providers.server [serve] --model M``."""

from mlx_providers.server.cli import main

raise SystemExit(main())
