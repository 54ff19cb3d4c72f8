from train.cli import main

raise SystemExit(main())
