from colo_kit_cli import main

raise SystemExit(main())
