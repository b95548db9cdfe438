from colo_kit.cli import main

raise SystemExit(main())
