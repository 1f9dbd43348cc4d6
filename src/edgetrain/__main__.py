from edgetrain.cli import main

raise SystemExit(main())
