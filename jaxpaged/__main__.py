from jaxpaged.generate import main

raise SystemExit(main())
