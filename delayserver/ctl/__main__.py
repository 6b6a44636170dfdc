from delayserver.ctl import main

raise SystemExit(main())
