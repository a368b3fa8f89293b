from hmastack.cli import main

raise SystemExit(main())
