from tailtamer.cli import main

raise SystemExit(main())
