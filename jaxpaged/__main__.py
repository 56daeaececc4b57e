from jaxpaged.entrypoints.generate import main

raise SystemExit(main())
