from kvlab.exercises.build import main

raise SystemExit(main())
