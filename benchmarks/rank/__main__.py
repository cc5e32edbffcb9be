from benchmarks.rank.main import main

raise SystemExit(main())
