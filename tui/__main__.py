"""`python -m localrt.tui [NAME]`: the chat app without going through the `localrt` CLI."""

from localrt.tui.launch import main

raise SystemExit(main())
