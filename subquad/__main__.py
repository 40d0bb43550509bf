from subquad.cli import main

raise SystemExit(main())
