from localrt.cli import main

raise SystemExit(main())
